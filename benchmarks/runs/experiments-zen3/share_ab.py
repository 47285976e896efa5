"""Exploratory: -k auto with carry_prior 0.5 (the fresh/carried mixture) vs ~1 (carried evidence alone, the old estimate), interleaved."""
import sys, time, statistics
import specdec
from specdec.control import AutoK
from specdec.bench.prompts import load_prompts, limit_per_category
draft = sys.argv[1]; kw = {}
if sys.argv[2] != "-": kw["draft_backend"] = sys.argv[2]
if sys.argv[3] != "-": kw["draft_dtype"] = sys.argv[3]
variants = [True, False]
engs = {}
for v in variants:
    e = specdec.Engine.load("qwen2.5-coder-1.5b", draft, dtype="int8", **kw)
    ctl = e.auto_controller()
    e._auto = AutoK(ctl.costs, max_k=ctl.max_k, share_pricing=v)
    engs[v] = e
ps = limit_per_category(load_prompts("builtin"), 2)
for v, e in engs.items():
    e.generate(e.encode(ps[0].text, chat=True), max_new_tokens=8, num_speculative_tokens="auto")
res = {v: {} for v in variants}; cat = {}; info = {v: {} for v in variants}
for p in ps:
    ids = engs[variants[0]].encode(p.text, chat=True); cat[p.id] = p.category
    for rep in range(2):
        for v in (variants if rep == 0 else variants[::-1]):
            t0 = time.perf_counter()
            r = engs[v].generate(ids, max_new_tokens=64, num_speculative_tokens="auto")
            res[v].setdefault(p.id, []).append(time.perf_counter() - t0)
            info[v].setdefault(p.id, []).append(f"{r.stats.accepted}/{r.stats.drafted} plain {r.stats.plain_steps}")
    print(p.id, p.category, " | ".join(f"share={v} {statistics.median(res[v][p.id]):.2f}s {info[v][p.id]}" for v in variants),
          f" ratio {statistics.median(res[variants[0]][p.id]) / statistics.median(res[variants[1]][p.id]):.3f}", flush=True)
for c in sorted(set(cat.values()), key=list(cat.values()).index) + ["all"]:
    ids = [i for i in cat if c in ("all", cat[i])]
    t = {v: sum(statistics.median(res[v][i]) for i in ids) for v in variants}
    print(c, " ".join(f"share={v} {t[v]:.2f}s" for v in variants), f" time ratio share-priced/main {t[variants[0]] / t[variants[1]]:.3f}")
