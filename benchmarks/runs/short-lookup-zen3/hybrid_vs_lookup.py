"""The int8 1.5B target with the int4 0.5B hybrid (lookup+draft) and with prompt lookup alone, both -k auto,
against int8 plain, interleaved per prompt (usage: PROMPT_IDS REPEATS); the run that showed the summarization loss."""
import sys, time, statistics
import specdec
from specdec.bench.prompts import load_prompts
from specdec.engine import Engine
hy = Engine.load("qwen2.5-coder-1.5b", "lookup+qwen2.5-coder-0.5b", dtype="int8", draft_dtype="int4")
lk = Engine(hy.target_runner, hy.tokenizer, None, None, lookup=True)
hy.auto_controller(); lk.auto_controller()
prompts = {p.id: p for p in load_prompts("builtin")}
res = {}
for rep in range(int(sys.argv[2])):
  for pid in sys.argv[1].split(","):
    p = prompts[pid]
    for name, e, kw in (("plain", hy, dict(use_draft=False)), ("hybrid", hy, {}), ("lookup", lk, {})):
        t = time.perf_counter()
        r = e.generate(p.text, max_new_tokens=64, chat=True, num_speculative_tokens="auto", **kw)
        w = time.perf_counter() - t
        res.setdefault((pid, name), []).append(w)
        print(pid, rep, name, f"{w:.2f}", r.stats.target_forwards, f"draft {r.stats.draft_s:.2f}", flush=True)
for pid in sys.argv[1].split(","):
    m = {n: statistics.median(res[(pid, n)]) for n in ("plain","hybrid","lookup")}
    print(pid, " ".join(f"{n} {m['plain']/m[n]:.2f}x" for n in m))
