"""Each zoo draft in int4 (specdec's kernel, whatever the checkout on PYTHONPATH builds) against the same draft
on llama.cpp (its GGUF, exact=False): ms per drafted token and per 64-token catch-up (interleaved, median of
6 x 16 and 6), and how often each one's greedy next token equals the draft's own fp32 transformers model's
on four texts (teacher-forced; the fp32 model is the GGUF's weights dequantized).
Usage: python drafts_int4.py [--no-timing] [names...]"""
import statistics, sys, time

import torch

from specdec import zoo
from specdec.backends.llamacpp import LlamaCppSession
from specdec.backends.lean import supports
from specdec.loading import load_hf, load_int4_draft

torch.set_num_threads(2)
TEXTS = [
    "Translate to French: The weather is nice today and we are going to the park with our friends. "
    "Le temps est beau aujourd'hui et nous allons au parc avec nos amis.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(fibonacci(i))\n",
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the "
    "fall of Constantinople in 1453.",
    "Question: What is the capital of Australia? Answer: The capital of Australia is Canberra, which was chosen "
    "as a compromise between Sydney and Melbourne.",
]
args = [a for a in sys.argv[1:] if not a.startswith("--")]
timing = "--no-timing" not in sys.argv
for name in args or ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]:
    runner, tok = load_int4_draft(name)
    session = LlamaCppSession(zoo.gguf_path(name), n_ctx=1024, n_threads=2, exact=False)
    if timing:
        toks = list(range(1000, 1064))
        res = {"int4": ([], []), "llama.cpp": ([], [])}
        for rep in range(6):
            runner.reset(); runner.forward(list(range(3000, 3040)), last_n=1)
            t0 = time.perf_counter(); runner.forward(toks, last_n=1); res["int4"][1].append(time.perf_counter() - t0)
            for i in range(16):
                t0 = time.perf_counter(); runner.forward([2000 + i]); res["int4"][0].append(time.perf_counter() - t0)
            session.remove(0); session.decode(list(range(3000, 3040)), 0, 1)
            t0 = time.perf_counter(); session.decode(toks, 40, 1); res["llama.cpp"][1].append(time.perf_counter() - t0)
            for i in range(16):
                t0 = time.perf_counter(); session.decode([2000 + i], 104 + i, 1)
                res["llama.cpp"][0].append(time.perf_counter() - t0)
        for k, (one, batch) in res.items():
            print(f"{name} {k}: {1000 * statistics.median(one):.1f} ms per drafted token, "
                  f"{1000 * statistics.median(batch):.0f} ms per 64-token catch-up", flush=True)
    fp32, _ = load_hf(name, dtype="fp32")
    agree = {"int4": [], "llama.cpp": []}
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        with torch.inference_mode():
            ref = fp32(torch.tensor([ids])).logits[0].argmax(-1)
        runner.reset()
        agree["int4"] += (runner.forward(ids).argmax(-1) == ref).tolist()
        session.remove(0)
        agree["llama.cpp"] += (torch.from_numpy(session.decode(ids, 0, len(ids))).argmax(-1) == ref).tolist()
    print(f"{name}: next token equal to fp32's, {len(agree['int4'])} positions: "
          + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in agree.items()), flush=True)
    del runner, session, fp32
