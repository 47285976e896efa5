"""gemma3-270m as a draft: int4 LeanRunner vs llama.cpp (exact=False), per drafted token and per 64-token
catch-up (same process, interleaved), and how often the int4 draft's greedy token equals the int8
transformers model's and llama.cpp's (Q4_K_M) on a real text."""
import statistics, time

import torch

from specdec import zoo
from specdec.backends.llamacpp import LlamaCppSession
from specdec.loading import load_hf, load_int4_draft

torch.set_num_threads(2)
t0 = time.perf_counter()
r, tok = load_int4_draft("gemma3-270m")
print(f"int4 load {time.perf_counter() - t0:.1f} s", flush=True)
s = LlamaCppSession(zoo.gguf_path("gemma3-270m"), n_ctx=1024, n_threads=2, exact=False)
toks = list(range(1000, 1064))
res = {"int4": ([], []), "llama.cpp": ([], [])}
for rep in range(6):
    r.reset(); r.forward(list(range(3000, 3040)), last_n=1)
    t0 = time.perf_counter(); r.forward(toks, last_n=1); res["int4"][1].append(time.perf_counter() - t0)
    for i in range(16):
        t0 = time.perf_counter(); r.forward([2000 + i]); res["int4"][0].append(time.perf_counter() - t0)
    s.remove(0); s.decode(list(range(3000, 3040)), 0, 1)
    t0 = time.perf_counter(); s.decode(toks, 40, 1); res["llama.cpp"][1].append(time.perf_counter() - t0)
    for i in range(16):
        t0 = time.perf_counter(); s.decode([2000 + i], 104 + i, 1); res["llama.cpp"][0].append(time.perf_counter() - t0)
for k, (one, batch) in res.items():
    print(f"{k}: {1000 * statistics.median(one):.1f} ms per drafted token, "
          f"{1000 * statistics.median(batch):.0f} ms per 64-token catch-up", flush=True)

# agreement of next-token argmax along a real text (teacher forcing)
text = ("The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft model propose "
        "several tokens which a large target model then checks in a single forward pass; every accepted token "
        "saves one step of the large model. Translate to French: The weather is nice today and we are going "
        "to the park with our friends.")
ids = tok(text)["input_ids"]
m8, _ = load_hf("gemma3-270m", dtype="int8")
with torch.inference_mode():
    ref8 = m8(torch.tensor([ids])).logits[0].argmax(-1)
r.reset()
got4 = r.forward(ids).argmax(-1)
s.remove(0)
lc = torch.from_numpy(s.decode(ids, 0, len(ids))).argmax(-1)
print(f"{len(ids)} positions: int4 == int8 argmax {float((got4 == ref8).float().mean()):.3f}; "
      f"int4 == llama.cpp {float((got4 == lc).float().mean()):.3f}; int8 == llama.cpp {float((ref8 == lc).float().mean()):.3f}")
