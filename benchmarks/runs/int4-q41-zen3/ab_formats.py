"""The int4 kernel before (f335ab6, build_old.sh) and after the Q4_1-like format, interleaved in one process:
the 0.5B draft's four layer shapes at 1 and 64 rows, sd_linear4 called directly (random weights in each format;
the formats differ, so the outputs are not compared), median of 7 calls, 5 repeats alternating the order."""
import ctypes, statistics, time, sys
import torch
from specdec.backends import kernel
from specdec.backends.int4 import Int4Linear
torch.set_num_threads(2)
new = kernel.library()
old = ctypes.CDLL("/tmp/old/old.so")
i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
old.sd_linear4.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, i64, i32, ptr, i64, i32, i32]
old.sd_pack4.argtypes = [ptr, ptr, i32, i32, i32, ptr, ptr]
gen = torch.Generator().manual_seed(0)
shapes = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
def med(fn, n=7):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
L = {}
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, generator=gen) * 0.05
    newl = Int4Linear.from_weight(w)
    kp = kernel.padded(k); rows = -(-n // 4) * 4
    v = torch.randint(-7, 8, (n, k), dtype=torch.int8, generator=gen); sc = torch.rand(n, -(-k // 64)) * 0.01
    op = torch.empty(rows, kp // 2, dtype=torch.uint8); os_ = torch.empty(rows * kp // 64)
    old.sd_pack4(v.data_ptr(), sc.data_ptr(), n, k, kp, op.data_ptr(), os_.data_ptr())
    L[name] = (newl, op, os_, n, k, kp)
for m in (1, 64):
    tot = {"old": 0.0, "new": 0.0}
    for rep in range(5):
        for name, (newl, op, os_, n, k, kp) in L.items():
            x = torch.randn(m, k, generator=gen); y = torch.empty(m, n)
            f_old = lambda: old.sd_linear4(op.data_ptr(), os_.data_ptr(), None, n, k, kp, x.data_ptr(), k, m, y.data_ptr(), n, 2, 0)
            f_new = lambda: new.sd_linear4(newl.packed.data_ptr(), newl.scales.data_ptr(), None, n, k, kp, x.data_ptr(), k, m, y.data_ptr(), n, 2, int(sys.argv[1]) if len(sys.argv) > 1 else 0)
            f_old(); f_new()
            if rep % 2: tot["new"] += med(f_new); tot["old"] += med(f_old)
            else: tot["old"] += med(f_old); tot["new"] += med(f_new)
    print(m, "rows: old %.2f ms new %.2f ms (new/old %.2f)" % (1000 * tot["old"] / 5, 1000 * tot["new"] / 5, tot["new"] / tot["old"]))
