"""A/B in one process, methods interleaved prompt by prompt: the hybrid drafter (short-lookup fallback on) with the
sources asked in the drafter's order ("old": a controller without prospect()) and ranked by AutoK.prospect ("new"),
each with its own -k auto controller, prompt lookup alone ("lookup"), and int8 plain."""
import sys, time, statistics, math
from dataclasses import replace
import specdec
from specdec.bench.prompts import load_prompts, limit_per_category
from specdec.engine import Engine, MAX_AUTO_K
from specdec.control import AutoK
draft = sys.argv[1] if len(sys.argv) > 1 else "lookup+qwen2.5-coder-0.5b"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
hy = Engine.load("qwen2.5-coder-1.5b", draft, dtype="int8", draft_dtype="int4")
lk = Engine(hy.target_runner, hy.tokenizer, None, None, lookup=True)
hy.auto_controller(); lk.auto_controller()
class Unranked:
    """The controller without prospect(): plan() asks the drafter's sources in its own order."""
    def __init__(self, inner): self.inner = inner
    def choose(self, *a, **k): return self.inner.choose(*a, **k)
    def observe(self, *a, **k): return self.inner.observe(*a, **k)
    def reset(self): return self.inner.reset()
old = Unranked(AutoK(replace(hy._measured_costs), max_k=MAX_AUTO_K))
new = AutoK(replace(hy._measured_costs), max_k=MAX_AUTO_K)
methods = (("plain", hy, dict(use_draft=False)), ("old", hy, dict(num_speculative_tokens=old)),
           ("new", hy, dict(num_speculative_tokens=new)), ("lookup", lk, dict(num_speculative_tokens="auto")))
prompts = limit_per_category(load_prompts("builtin"), 2)
res = {}
for p in prompts:
    for rep in range(reps):
        ref = None
        for name, e, kw in methods:
            t = time.perf_counter()
            r = e.generate(p.text, max_new_tokens=64, chat=True, **kw)
            w = time.perf_counter() - t
            if ref is None: ref = r.token_ids
            assert r.token_ids == ref, (p.id, name)
            res.setdefault((p.id, name), []).append(w)
            print(p.id, p.category, rep, name, f"{w:.2f}", r.stats.target_forwards, f"draft {r.stats.draft_s:.2f}",
                  "", flush=True)
cats = {}
for p in prompts:
    m = {n: statistics.median(res[(p.id, n)]) for n, _, _ in methods}
    print(p.id, p.category, " ".join(f"{n} {m['plain']/m[n]:.2f}x" for n in m))
    for n in m: cats.setdefault((p.category, n), []).append(m["plain"] / m[n])
g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
for n, _, _ in methods:
    print(f"{n:7s}", " ".join(f"{c[:5]} {g(cats[(c, n)]):.2f}" for c in dict.fromkeys(p.category for p in prompts)),
          f"| all {g([x for (c, m), v in cats.items() if m == n for x in v]):.2f}")
