"""Deterministic replay of -k auto and fixed γ = 3 with the real 0.5B draft (int8 and int4, prompt lookup
first: the hybrid drafter) against a target whose greedy continuation is known: the plain outputs in
a `specdec bench` run's results.jsonl.  The target is a stand-in that predicts that continuation, so
no target forward runs; step times come from a cost table (TABLES, measured with `specdec profile`),
not the clock, so drafter choices (dtype, catch-up window) compare without timing noise.  Speedups
are decode time only (the prefill is the same for every method).

usage: .venv/bin/python benchmarks/replay_drafts.py BENCH_DIR [zen1|xeon] [WINDOWS, e.g. 64,128] [INT4_COST_RATIO]
"""
import json
import math
import sys
from dataclasses import replace
import torch
import specdec
from specdec.backends.base import Capabilities
from specdec.bench.prompts import load_prompts, limit_per_category
from specdec.control import AutoK, Costs, FixedK
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.model import ModelDrafter
from specdec.loop import run, StopCondition
from specdec.sampling import SamplingParams

# target t(n) ms (1.5B int8), the int8 0.5B draft's ms per token and per caught-up token; the int4 draft's
# per-token cost is the int8 one times INT4_COST_RATIO (29.0 / 42.8: both measured interleaved on Zen 1)
TABLES = {
    "zen1": ({1: 97, 2: 100, 3: 115, 4: 129, 6: 175, 8: 219, 9: 251}, 41.4, 8.6),
    "xeon": ({1: 55.7, 2: 58.1, 3: 58.5, 4: 60.9, 6: 64.3, 8: 70.7, 9: 79.7}, 22.8, 2.3),
}

class Replay:
    """A target that always predicts the reference continuation (one-hot logits)."""
    def __init__(self, seq, vocab):
        self.seq, self.vocab_size, self.max_context = seq, vocab, 32768
        self.capabilities = Capabilities(rollback=True, logits_all_positions=True, batching=False, batch_invariant=True)
        self.tokens, self.log = [], []
    def forward(self, new, last_n=None):
        start = len(self.tokens); self.tokens += list(new); self.log.append(len(new))
        n = len(new) if last_n is None else min(last_n, len(new))
        out = torch.zeros(n, self.vocab_size)
        for row, pos in enumerate(range(len(self.tokens) - n, len(self.tokens))):
            ok = pos + 1 < len(self.seq) and self.tokens[: pos + 1] == self.seq[: pos + 1]
            out[row, self.seq[pos + 1] if ok else 0] = 1.0
        return out
    def rollback(self, n): del self.tokens[n:]
    def reset(self): self.tokens = []

class Counting:
    """Wraps the draft runner: logs tokens fed per forward."""
    def __init__(self, inner): self.inner, self.log = inner, []
    def __getattr__(self, name): return getattr(self.inner, name)
    @property
    def tokens(self): return self.inner.tokens
    def forward(self, new, last_n=None):
        self.log.append(len(new)); return self.inner.forward(new, last_n)

def main():
    bench, table = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "zen1"
    windows = [int(w) if w != "none" else None for w in (sys.argv[3] if len(sys.argv) > 3 else "64,128").split(",")]
    tms, dms, sms = TABLES[table]
    ref = {}
    for line in open(f"{bench}/results.jsonl"):
        r = json.loads(line)
        if r["method"] == "plain" and r["repeat"] == 0:
            ref[r["prompt_id"]] = r["token_ids"]
    eng = specdec.Engine.load("qwen2.5-coder-0.5b", None, dtype="int8")  # the draft model only
    from specdec.backends.lean import LeanRunner
    drafts = {"int8": Counting(eng.target_runner), "int4": Counting(LeanRunner(eng.target_runner.model, int4=True))}
    dcost = {"int8": dms, "int4": dms * float(sys.argv[4]) if len(sys.argv) > 4 else dms * 29.0 / 42.8}
    prompts = [p for p in limit_per_category(load_prompts("builtin"), 2) if p.id in ref]
    configs = [(kind, w, d) for kind in ("auto", "g3") for w in windows for d in drafts]
    res = {c: {} for c in configs}
    ctls = {}
    for p in prompts:
        ids = eng.encode(p.text, chat=True)
        seq = ids + ref[p.id]
        n_new = len(ref[p.id])
        plain_ms = n_new * tms[1]
        for kind, w, dk in configs:
            draft = drafts[dk]
            costs0 = Costs(tms, dcost[dk], sync_ms=sms)
            target = Replay(seq, eng.target_runner.vocab_size)
            drafter = HybridDrafter(ModelDrafter(draft, SamplingParams(), target_vocab_size=target.vocab_size, window=w))
            if (kind, w, dk) not in ctls:  # one controller per configuration, across prompts (as an engine keeps it)
                ctls[(kind, w, dk)] = AutoK(replace(costs0), max_k=8, cost_ewma=0.0) if kind == "auto" else FixedK(3)
            ctl = ctls[(kind, w, dk)]
            draft.log.clear()
            out = run(target, ids, StopCondition(max_new_tokens=n_new, eos_token_ids=frozenset()), drafter, ctl)
            assert list(out.token_ids)[:n_new] == ref[p.id], (p.id, kind, w, dk)
            tgt = sum(costs0.target(n) for n in target.log[1:])  # prefill excluded (same for plain)
            drf = sum(dcost[dk] + sms * (n - 1) for n in draft.log)
            res[(kind, w, dk)][p.id] = (p.category, plain_ms / (tgt + drf), len(target.log) - 1, sum(draft.log))
    cats = ["code", "summarization", "qa", "translation", "math", "chat"]
    for c, rows in res.items():
        by = {cat: [v[1] for v in rows.values() if v[0] == cat] for cat in cats}
        g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
        allv = [v[1] for v in rows.values()]
        print(f"{c[0]:5s} W={str(c[1]):5s} {c[2]}", " ".join(f"{cat[:5]} {g(by[cat]):.3f}" for cat in cats), f"| all {g(allv):.3f}",
              f"fwd {sum(v[2] for v in rows.values())} draft-tokens {sum(v[3] for v in rows.values())}")

if __name__ == "__main__":
    main()
