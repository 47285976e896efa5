"""smollm2-135m as a draft: int4 LeanRunner vs llama.cpp (exact=False), per drafted token and per 64-token catch-up."""
import time, statistics, torch
from specdec.loading import load_int4_draft
from specdec.backends.llamacpp import LlamaCppSession
from specdec import zoo
torch.set_num_threads(2)
r, tok = load_int4_draft("smollm2-135m")
s = LlamaCppSession(zoo.gguf_path("smollm2-135m"), n_ctx=1024, n_threads=2, exact=False)
toks = list(range(100, 164))
res = {"int4": ([], []), "llama.cpp": ([], [])}
for rep in range(6):
    # int4
    r.reset(); r.forward(list(range(300, 340)), last_n=1)
    t0 = time.perf_counter(); r.forward(toks, last_n=1); res["int4"][1].append(time.perf_counter() - t0)
    for i in range(16):
        t0 = time.perf_counter(); r.forward([200 + i]); res["int4"][0].append(time.perf_counter() - t0)
    # llama.cpp
    s.remove(0); s.decode(list(range(300, 340)), 0, 1)
    t0 = time.perf_counter(); s.decode(toks, 40, 1); res["llama.cpp"][1].append(time.perf_counter() - t0)
    for i in range(16):
        t0 = time.perf_counter(); s.decode([200 + i], 104 + i, 1); res["llama.cpp"][0].append(time.perf_counter() - t0)
for k, (one, batch) in res.items():
    print(f"{k}: {1000 * statistics.median(one):.1f} ms per drafted token, {1000 * statistics.median(batch):.0f} ms per 64-token catch-up", flush=True)
