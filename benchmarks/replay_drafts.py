"""Deterministic replay of -k auto and fixed γ = 3 with the real 0.5B draft (int8 and int4, prompt lookup
first: the hybrid drafter) against a target whose greedy continuation is known: the plain outputs in
a `specdec bench` run's results.jsonl.  The target is a stand-in that predicts that continuation, so
no target forward runs; step times come from a cost table (TABLES, measured with `specdec profile`),
not the clock, so drafter choices (dtype, catch-up window) compare without timing noise.  Speedups
are decode time only (the prefill is the same for every method).  With --simulate SEEDS the
controller learns online (as in an engine) from a virtual clock instead: each forward advances it by
its table cost times lognormal noise and a slowly wandering machine speed (seeded), which is how a
shared 2-core machine behaves; one line per seed.

usage: .venv/bin/python benchmarks/replay_drafts.py BENCH_DIR [--table zen1|xeon] [--windows 64,128]
       [--drafts int8,int4] [--gammas 3] [--int4-ratio R] [--simulate 0,1,2] [--noise 0.1]
"""
import argparse
import json
import math
import random
from dataclasses import replace
import torch
import specdec
from specdec.backends.base import Capabilities
from specdec.bench.prompts import load_prompts, limit_per_category
from specdec.algorithm.control import AutoK, Costs, FixedK
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.model import ModelDrafter
import specdec.algorithm.loop
from specdec.algorithm.loop import run, StopCondition
from specdec.algorithm.sampling import SamplingParams

# target t(n) ms (1.5B int8), the int8 0.5B draft's ms per token and per caught-up token; the int4 draft's
# per-token cost is the int8 one times INT4_COST_RATIO (29.0 / 42.8: both measured interleaved on Zen 1)
TABLES = {
    "zen1": ({1: 97, 2: 100, 3: 115, 4: 129, 6: 175, 8: 219, 9: 251}, 41.4, 8.6),
    "zen3": ({1: 129.1, 2: 122.2, 3: 126.1, 4: 140.9, 6: 187.7, 8: 244.9, 9: 256.3}, 27.8, 6.44),
    "xeon": ({1: 55.7, 2: 58.1, 3: 58.5, 4: 60.9, 6: 64.3, 8: 70.7, 9: 79.7}, 22.8, 2.3),
}

class Clock:
    """Virtual time in seconds: forwards advance it by their cost times noise (see --simulate)."""
    def __init__(self, seed, noise):
        self.now, self.rng, self.noise, self.speed = 0.0, random.Random(seed), noise, 1.0
    def perf_counter(self): return self.now
    def spend(self, ms):
        if self.noise:  # a machine that wanders: slow drift of its speed, and per-forward jitter
            self.speed = min(max(self.speed * math.exp(self.rng.gauss(0, self.noise / 4)), 0.75), 1.5)
            ms *= self.speed * math.exp(self.rng.gauss(0, self.noise))
        self.now += ms / 1000
        return ms

CLOCK = None  # the running Clock while simulating


class Replay:
    """A target that always predicts the reference continuation (one-hot logits)."""
    def __init__(self, seq, vocab, costs=None):
        self.seq, self.vocab_size, self.max_context, self.costs = seq, vocab, 32768, costs
        self.capabilities = Capabilities(rollback=True, logits_all_positions=True, batching=False, batch_invariant=True)
        self.tokens, self.log = [], []
    def forward(self, new, last_n=None):
        start = len(self.tokens); self.tokens += list(new); self.log.append(len(new))
        if CLOCK is not None and self.costs is not None:
            CLOCK.spend(self.costs.target(len(new)) if start else 0.0)  # the prefill is not timed
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
    def __init__(self, inner): self.inner, self.log, self.ms = inner, [], (0.0, 0.0)
    def __getattr__(self, name): return getattr(self.inner, name)
    @property
    def tokens(self): return self.inner.tokens
    def forward(self, new, last_n=None):
        self.log.append(len(new))
        if CLOCK is not None:
            CLOCK.spend(self.ms[0] + self.ms[1] * (len(new) - 1))
        return self.inner.forward(new, last_n)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("--table", default="zen1", choices=sorted(TABLES))
    ap.add_argument("--windows", default="64,128")
    ap.add_argument("--drafts", default="int8,int4")
    ap.add_argument("--gammas", default="3")
    ap.add_argument("--int4-ratio", type=float, default=29.0 / 42.8)
    ap.add_argument("--simulate", default="", help="seeds: learn online from a noisy virtual clock")
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--variants", default="", help="extra -k auto controllers: 'name:field=value,...;...'")
    ap.add_argument("--verbose", action="store_true", help="per prompt: speedup and plain steps of each auto")
    ap.add_argument("--repeats", type=int, default=1, help="each prompt this many times in a row, as the bench")
    a = ap.parse_args()
    eng = specdec.Engine.load("qwen2.5-coder-0.5b", None, dtype="int8")  # the draft model only
    from specdec.backends.lean import LeanRunner
    make = {"int8": lambda: eng.target_runner, "int4": lambda: LeanRunner(eng.target_runner.model, int4=True)}
    drafts = {d: Counting(make[d]()) for d in a.drafts.split(",")}
    global CLOCK
    for seed in a.simulate.split(",") if a.simulate else [None]:
        if seed is not None:
            CLOCK = Clock(int(seed), a.noise)
            specdec.algorithm.loop.time = CLOCK  # the loop's timings come from the virtual clock
            print(f"seed {seed}:")
        replay(a, eng, drafts, CLOCK)


def replay(a, eng, drafts, clock):
    windows = [int(w) if w != "none" else None for w in a.windows.split(",")]
    tms, dms, sms = TABLES[a.table]
    ref = {}
    for line in open(f"{a.bench}/results.jsonl"):
        r = json.loads(line)
        if r["method"] == "plain" and r["repeat"] == 0:
            ref[r["prompt_id"]] = r["token_ids"]
    dcost = {"int8": dms, "int4": dms * a.int4_ratio}
    prompts = [p for p in limit_per_category(load_prompts("builtin"), 2) if p.id in ref]
    variants = {"auto": {}}
    for v in filter(None, a.variants.split(";")):
        name, _, fields = v.partition(":")
        variants[name] = {f.split("=")[0]: float(f.split("=")[1]) for f in fields.split(",") if f}
    kinds = list(variants) + [f"g{g}" for g in a.gammas.split(",") if g]
    configs = [(kind, w, d) for kind in kinds for w in windows for d in drafts]
    res = {c: {} for c in configs}
    ctls = {}
    for p, rep in ((p, rep) for p in prompts for rep in range(a.repeats)):
        ids = eng.encode(p.text, chat=True)
        seq = ids + ref[p.id]
        n_new = len(ref[p.id])
        stop = StopCondition(max_new_tokens=n_new, eos_token_ids=frozenset())
        plain_ms = n_new * tms[1]
        if clock:  # plain decoding under the same wandering machine
            started = clock.now
            run(Replay(seq, eng.target_runner.vocab_size, Costs(tms, dms)), ids, stop)
            plain_ms = 1000 * (clock.now - started)
        for kind, w, dk in configs:
            draft = drafts[dk]
            costs0 = Costs(tms, dcost[dk], sync_ms=sms)
            target = Replay(seq, eng.target_runner.vocab_size, costs0)
            draft.ms = (dcost[dk], sms)
            drafter = HybridDrafter(ModelDrafter(draft, SamplingParams(), target_vocab_size=target.vocab_size, window=w))
            if (kind, w, dk) not in ctls:  # one controller per configuration, across prompts (as an engine keeps it)
                ctls[(kind, w, dk)] = (AutoK(replace(costs0), max_k=8, cost_ewma=0.2 if clock else 0.0, **variants[kind])
                                       if kind in variants else FixedK(int(kind[1:])))
            draft.log.clear()
            started = clock.now if clock else 0.0
            out = run(target, ids, stop, drafter, ctls[(kind, w, dk)])
            assert list(out.token_ids)[:n_new] == ref[p.id], (p.id, kind, w, dk)
            tgt = sum(costs0.target(n) for n in target.log[1:])  # prefill excluded (same for plain)
            drf = sum(dcost[dk] + sms * (n - 1) for n in draft.log)
            if clock:
                tgt, drf = 1000 * (clock.now - started), 0.0
            res[(kind, w, dk)][(p.id, rep)] = (p.category, plain_ms / (tgt + drf), len(target.log) - 1,
                                                sum(draft.log), out.stats.plain_steps)
    cats = ["code", "summarization", "qa", "translation", "math", "chat"]
    if a.verbose:
        for key in res[configs[0]]:
            print(key, " ".join(f"{c[0]} {res[c][key][1]:.2f}/{res[c][key][4]}" for c in configs if c[0] in variants))
    for c, rows in res.items():
        by = {cat: [v[1] for v in rows.values() if v[0] == cat] for cat in cats}
        g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
        allv = [v[1] for v in rows.values()]
        print(f"{c[0]:5s} W={str(c[1]):5s} {c[2]}", " ".join(f"{cat[:5]} {g(by[cat]):.3f}" for cat in cats),
              f"| all {g(allv):.3f}", f"fwd {sum(v[2] for v in rows.values())}",
              f"draft-tokens {sum(v[3] for v in rows.values())} plain-steps {sum(v[4] for v in rows.values())}",
              f"min {min(allv):.2f}", flush=True)


if __name__ == "__main__":
    main()
