"""The int4 kernel before (./old.so, from build_old.sh) and after 337e141, interleaved in one process.

1. The 0.5B draft's four layer shapes at 1 and 64 rows (random int4 weights), sd_linear4 called directly;
   order rotated per repeat, one unmeasured call first; outputs compared bit for bit.
2. The qwen2.5-coder-0.5b int4 draft (LeanRunner): a 64-token catch-up after 100 tokens, and one-token
   forwards, with kernel._lib switched between the two libraries; logits compared bit for bit.
"""
import ctypes
import statistics
import time

import torch

from specdec.backends import kernel
from specdec.backends.int4 import Int4Linear
from specdec.loading import load_int4_draft

torch.set_num_threads(2)
new = kernel.library()
old = ctypes.CDLL("./old.so")
for name in ("sd_linear", "sd_pack", "sd_isa", "sd_attention", "sd_attention_isa", "sd_openmp", "sd_linear4",
             "sd_pack4", "sd_pack4_int8", "sd_isa4"):
    getattr(old, name).argtypes = getattr(new, name).argtypes
    getattr(old, name).restype = getattr(new, name).restype
libs = {"before": old, "after": new}


def median_time(fn, n=7):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


gen = torch.Generator().manual_seed(0)
shapes = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
layers = {name: Int4Linear.from_weight(torch.randn(n, k, generator=gen) * 0.05) for name, (n, k) in shapes.items()}
for m in (1, 64):
    total = {name: 0.0 for name in libs}
    for rep in range(6):
        order = list(libs)[rep % 2:] + list(libs)[: rep % 2]
        for lname, (n, k) in shapes.items():
            lin = layers[lname]
            x = torch.randn(m, k, generator=gen)
            outs = {}
            for j, name in enumerate(order[:1] + order):
                y = torch.empty(m, n)
                call = lambda: libs[name].sd_linear4(lin.packed.data_ptr(), lin.scales.data_ptr(), None, n, k,
                                                     lin.packed.shape[1] * 2, x.data_ptr(), k, m, y.data_ptr(), n, 2, 0)
                t = median_time(call)
                if j:
                    total[name] += t
                outs[name] = y.clone()
            assert torch.equal(outs["before"], outs["after"]), (lname, m)
    print(f"four layer shapes, {m} rows: " + ", ".join(f"{name} {1000 * t / 6:.2f} ms" for name, t in total.items())
          + f" (before / after {total['before'] / total['after']:.2f}x), same bits", flush=True)

runner, _ = load_int4_draft("qwen2.5-coder-0.5b")
ids = list(range(1000, 1300))
res = {name: {1: [], 64: []} for name in libs}
logits = {}
for rep in range(8):
    for name in (list(libs) if rep % 2 else list(libs)[::-1]):
        kernel._lib = libs[name]
        runner.reset()
        runner.forward(ids[:100], last_n=1)
        start = time.perf_counter()
        a = runner.forward(ids[100:164], last_n=1)
        res[name][64].append(time.perf_counter() - start)
        one = []
        for j in range(8):
            start = time.perf_counter()
            b = runner.forward([ids[164 + j]])
            one.append(time.perf_counter() - start)
        res[name][1].append(statistics.median(one))
        logits[name] = (a, b)
kernel._lib = new
assert all(torch.equal(x, y) for x, y in zip(logits["before"], logits["after"]))
for name in libs:
    print(f"0.5B int4 draft, {name}: 64-token catch-up {1000 * statistics.median(res[name][64]):.0f} ms, "
          f"one token {1000 * statistics.median(res[name][1]):.1f} ms", flush=True)
print("same logits before and after")
