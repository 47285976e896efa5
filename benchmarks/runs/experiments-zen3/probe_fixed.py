"""Exploratory: -k auto, draft catch-up probe window 16 vs none (the whole 64-token window at once), interleaved.
usage: PYTHONPATH=/work/dev python /tmp/probe_ab.py DRAFT BACKEND|- DTYPE|- [P1,P2,...] [prompt ids]"""
import sys, time, statistics
import specdec
from specdec.drafters import model as dm
from specdec.bench.prompts import load_prompts, limit_per_category
draft = sys.argv[1]; kw = {}; import os; K = int(os.environ.get("K", "3"))
if sys.argv[2] != "-": kw["draft_backend"] = sys.argv[2]
if sys.argv[3] != "-": kw["draft_dtype"] = sys.argv[3]
variants = [None if v == "none" else int(v) for v in (sys.argv[4] if len(sys.argv) > 4 else "16,none").split(",")]
P = {"p": None}
orig = dm.DraftCache.__init__
def init(self, runner, window=64, probe_window=16):
    orig(self, runner, window, P["p"])
dm.DraftCache.__init__ = init
engs = {}
for v in variants:
    P["p"] = v
    engs[v] = specdec.Engine.load("qwen2.5-coder-1.5b", draft, dtype="int8", **kw)
ps = limit_per_category(load_prompts("builtin"), 2)
if len(sys.argv) > 5: ps = [p for p in ps if p.id in sys.argv[5].split(",")]
for v, e in engs.items():
    P["p"] = v
    e.generate(e.encode(ps[0].text, chat=True), max_new_tokens=8, num_speculative_tokens=K)
res = {v: {} for v in variants}; cat = {}
for p in ps:
    ids = engs[variants[0]].encode(p.text, chat=True); cat[p.id] = p.category
    for rep in range(2):
        for v in (variants if rep == 0 else variants[::-1]):
            P["p"] = v  # the drafter is made per generation
            t0 = time.perf_counter()
            r = engs[v].generate(ids, max_new_tokens=64, num_speculative_tokens=K)
            res[v].setdefault(p.id, []).append(time.perf_counter() - t0)
            if rep == 0: print("  ", v, "fwd", r.stats.target_forwards, "acc", r.stats.accepted, "/", r.stats.drafted, "draft_s %.2f" % r.stats.draft_s, flush=True)
    base = statistics.median(res[variants[-1]][p.id])
    print(p.id, p.category, len(r.token_ids), " ".join(f"P{v} {statistics.median(res[v][p.id]):.2f}s" for v in variants),
          " ratio vs last " + " ".join(f"{statistics.median(res[v][p.id]) / base:.3f}" for v in variants[:-1]), flush=True)
cats = sorted(set(cat.values()), key=list(cat.values()).index)
for c in cats + ["all"]:
    ids = [i for i in cat if c in ("all", cat[i])]
    print(c, " ".join(f"P{v} {sum(statistics.median(res[v][i]) for i in ids):.2f}s" for v in variants),
          " time ratio vs last " + " ".join(f"{sum(statistics.median(res[v][i]) for i in ids) / sum(statistics.median(res[variants[-1]][i]) for i in ids):.3f}" for v in variants[:-1]))
