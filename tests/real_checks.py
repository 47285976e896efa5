"""Checks the real-model tests of exact targets share (tests/test_real_int8.py, tests/test_real_gguf.py)."""

from __future__ import annotations

import random

import torch

from specdec.runtime.engine import Engine
from tests.conftest import real_model_threads

CODE = "import json\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n"
PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n",
    "The three most important ideas in thermodynamics are",
    "Once upon a time, in a village at the edge of a great forest,",
]
MAX_NEW = 40


def assert_bitwise_one_token_at_a_time(runner, mirror, tok, name: str, context: int) -> None:
    """`runner` takes forwards of k = 1..16 random tokens (each k once, shuffled) between random rollbacks
    while the context grows to `context`; `mirror`, over the same model, holds the same cache but evaluates
    those tokens one at a time: every logit must be identical.  (Fillers that grow the context go to both
    in one same call.)  Rollbacks drop up to 64 tokens, more than a rejected draft ever does; deeper ones are
    tested on the tiny models, where regrowing the context costs nothing."""
    rng = random.Random(name)
    specials = set(tok.all_special_ids)
    vocab = [i for i in range(min(len(tok), runner.vocab_size)) if i not in specials]
    base = list(tok(CODE, add_special_tokens=True)["input_ids"])
    filler = list(tok(CODE * 40, add_special_tokens=False)["input_ids"])
    ks = list(range(1, 17))
    rng.shuffle(ks)
    with real_model_threads():
        assert torch.equal(runner.forward(base), mirror.forward(base))
        for i, k in enumerate(ks):
            if i % 2 == 1:
                keep = rng.randrange(max(len(base), len(runner.tokens) - 64), len(runner.tokens) + 1)
                runner.rollback(keep)
                mirror.rollback(keep)
            goal = len(base) + (context - 16 - len(base)) * (i + 1) // len(ks)
            if len(runner.tokens) < goal:
                grow = filler[: goal - len(runner.tokens)]
                assert torch.equal(runner.forward(grow, last_n=1), mirror.forward(grow, last_n=1))
            new = [rng.choice(vocab) for _ in range(k)]
            logits = runner.forward(new)  # [k, V]
            expected = torch.cat([mirror.forward([t]) for t in new])  # k x [1, V]
            assert torch.equal(logits, expected), (name, len(runner.tokens), k)
    assert len(runner.tokens) >= context - 32 and runner.tokens == mirror.tokens


def plain_outputs(engine: Engine) -> dict[str, list[int]]:
    """The target's plain greedy tokens for PROMPTS."""
    with real_model_threads():
        return {p: engine.generate(p, max_new_tokens=MAX_NEW, use_draft=False).token_ids for p in PROMPTS}


def speculative_outputs(engine: Engine, prompts: list[str], k: int | str = 5) -> tuple[dict[str, list[int]], int, int]:
    """(tokens per prompt, draft tokens proposed, accepted) of speculative greedy decoding."""
    out, drafted, accepted = {}, 0, 0
    with real_model_threads():
        for prompt in prompts:
            result = engine.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k)
            out[prompt] = result.token_ids
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    return out, drafted, accepted
