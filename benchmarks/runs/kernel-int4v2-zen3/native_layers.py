"""One-token forwards and 64-token catch-ups of an int4 draft: its layers in one C call (runner.native) against
the torch path op by op, interleaved in one process.  Usage: python native_layers.py qwen2.5-coder-0.5b"""
import time, torch, statistics, sys
from specdec.loading import load_int4_draft
torch.set_num_threads(2)
name = sys.argv[1]
r, tok = load_int4_draft(name)
ids = list(range(1000, 1300))
res = {True: ([], []), False: ([], [])}
for rep in range(6):
    for native in ((True, False) if rep % 2 else (False, True)):
        r.native = native
        r.reset(); r.forward(ids[:100], last_n=1)
        s = time.perf_counter(); r.forward(ids[100:164], last_n=1); res[native][1].append(time.perf_counter() - s)
        one = []
        for j in range(10):
            s = time.perf_counter(); r.forward([ids[164 + j]]); one.append(time.perf_counter() - s)
        res[native][0].append(statistics.median(one))
for native, (one, batch) in res.items():
    print(f"{name} {'native' if native else 'torch'}: one token {1000*statistics.median(one):.1f} ms, 64-token catch-up {1000*statistics.median(batch):.0f} ms", flush=True)
