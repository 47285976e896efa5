"""What a cheaper target costs in quality: greedy agreement and perplexity against the fp32 model.

Speculative decoding is lossless with respect to the target it verifies with;
choosing an int8 (or bf16, or llama.cpp) target instead of the fp32 one is a
separate choice, and this module measures its price:

- **greedy agreement**: for each prompt, both targets decode greedily and the
  position of the first token where they differ is recorded (the full length
  when they never do); reported as the mean first-divergence position and the
  share of prompts with identical outputs;
- **perplexity** on fixed texts that ship with specdec (its own decode loop, as
  code, and a plain-language account of speculative decoding, as prose), in one forward per text.

``specdec quality`` prints the comparison; the README and docs/kernels.md quote it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from specdec.backends.base import ModelRunner


def perplexity(runner: ModelRunner, token_ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. given their prefixes, in one forward."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    runner.reset()
    logits = runner.forward(ids)  # [n, V]
    runner.reset()
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)  # [n-1, V]
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return float(math.exp(float(nll)))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where a and b differ (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass
class Agreement:
    divergences: list[int]  # per prompt: first position where the outputs differ
    lengths: list[int]  # per prompt: tokens compared (the shorter output)

    @property
    def mean_first_divergence(self) -> float:
        return sum(self.divergences) / len(self.divergences) if self.divergences else 0.0

    @property
    def identical_rate(self) -> float:
        return sum(d == n for d, n in zip(self.divergences, self.lengths)) / len(self.lengths) if self.lengths else 0.0


def agreement(outputs_a: Sequence[Sequence[int]], outputs_b: Sequence[Sequence[int]]) -> Agreement:
    return Agreement([first_divergence(a, b) for a, b in zip(outputs_a, outputs_b)],
                     [min(len(a), len(b)) for a, b in zip(outputs_a, outputs_b)])


def reference_texts() -> dict[str, str]:
    """The fixed texts perplexity is measured on: specdec's decode loop (code) and PROSE."""
    code = resources.files("specdec.algorithm").joinpath("loop.py").read_text(encoding="utf-8")
    prose = PROSE
    return {"code": code, "prose": prose}


# Written for this project (a plain-language account of speculative decoding); fixed so that
# perplexities stay comparable across versions.
PROSE = """\
Speculative decoding makes a large language model generate text faster without changing what it
generates. A small draft model, which is cheap to run, guesses the next few tokens one after another.
The large target model then reads all of the guesses in a single forward pass, which on most hardware
costs little more than reading one token, and checks them. Every guess that matches what the target
would have chosen itself is kept; at the first guess that does not match, the target's own choice is
used instead, and the remaining guesses are thrown away. Because the target decides every token, the
output is exactly what the target alone would have written, token for token, when decoding greedily.
When sampling, a careful acceptance rule, which compares the probabilities the two models give each
guess, keeps the distribution of the output equal to the target's own distribution.

How much faster this is depends on two numbers. The first is how often the draft guesses right, which
is high for predictable text such as code, boilerplate, or a translation that follows its source
closely, and lower for open-ended prose. The second is how much more the target pays to check several
tokens at once than to produce one. On a graphics card checking eight tokens costs about the same as
producing one; on an ordinary processor it may cost two or three times as much, and then only a draft
that is right most of the time saves anything. A good implementation therefore measures both numbers
on the machine it runs on, and drafts more tokens when guesses are cheap and likely to be accepted,
fewer when they are not, and none at all when drafting does not pay.
"""
