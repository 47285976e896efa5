"""Per-step trace of -k auto (source, lag, chosen k, the first three alphas; then drafted, accepted, draft ms,
target ms, tokens synced) for the int8 1.5B target and a hybrid draft (usage: PROMPT_IDS [DRAFT])."""
import sys, time, json
import specdec
from specdec.bench.prompts import load_prompts
eng = specdec.Engine.load("qwen2.5-coder-1.5b", sys.argv[2] if len(sys.argv)>2 else "lookup+qwen2.5-coder-0.5b", dtype="int8", draft_dtype="int4")
ctl = eng.auto_controller()
log = []
oc, oo = ctl.choose, ctl.observe
def choose(limit, lag=0, source="model"):
    k = oc(limit, lag, source); log.append([source, lag, k, [round(a,2) for a in ctl.alphas(source)[:3]]]); return k
def observe(drafted, accepted, draft_s, target_s, synced=0, source="model"):
    log[-1] += [drafted, accepted, round(draft_s*1000), round(target_s*1000), synced]; oo(drafted, accepted, draft_s, target_s, synced, source)
ctl.choose, ctl.observe = choose, observe
prompts = {p.id: p for p in load_prompts("builtin")}
ids = sys.argv[1].split(",")
for pid in ids:
    p = prompts[pid]
    log.clear()
    t = time.perf_counter()
    r = eng.generate(p.text, max_new_tokens=64, chat=True, num_speculative_tokens="auto")
    w = time.perf_counter() - t
    print(f"== {pid} {p.category} wall {w:.2f} new {len(r.token_ids)} fwd {r.stats.target_forwards} draft_s {r.stats.draft_s:.2f} target_s {r.stats.target_s:.2f}")
    for row in log: print("   ", row)
