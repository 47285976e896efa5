"""What a draft head costs per drafted token: the price the speculation controller plans with, and
`specdec profile`'s report of it against its target's one-token step.

A drafted token is one forward of the head over its own cache (specdec.head.model / specdec.head.fast);
:func:`measure_head` times `tokens` of them in a row after `prefix` positions in the head's cache, the
fastest of `repeats` runs (as specdec.runtime.profile.measure_drafting does for a draft model: what else
the machine does only slows a run).  The features fed are random: a forward's cost does not depend on
their values.

The controller prices a head like a draft model (:func:`head_ms_per_token`): measured once and cached per
head and machine like the runners' timings (specdec.runtime.profile), spot-checked on later loads.

Issue 38 asks a head to cost at most 0.08 of the int8 target's one-token step.  :func:`head_cost` times
the head and the target's one-token step after the same prefix (specdec.runtime.profile.measure_forwards)
and reports their ratio.  :func:`head_for_profile` finds and loads the head `specdec profile` reports on:
``--draft head`` / ``head:<dir>`` (alone or behind ``lookup+``), or, with no draft given, the head trained
for the target if there is one (specdec.head.store.default_directory).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec.backends.base import ModelRunner
from specdec.errors import SpecdecError
from specdec.head.fast import FastHead, for_drafting
from specdec.head.model import DraftHead, HeadCache
from specdec.head.use import LoadedHead, head_directory
from specdec.runtime.profile import CONTROL_REPEATS, SPOT_REPEATS, _cached, agrees, measure_forwards


def measure_head(head: Any, tokens: int = 8, prefix: int = 16, repeats: int = 3,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """ms per drafted token (as specdec.runtime.profile.measure_drafting times a draft model): `tokens` head forwards
    in a row after `prefix` cached positions (stand-in features and tokens), the fastest of `repeats` runs after a
    warm-up."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(prefix, int(head.width), generator=generator)  # [P, F]: a fused head's fuse runs too
    ids = head.vocab[torch.randint(len(head.vocab), (prefix,), generator=generator)]  # [P] target ids
    cache = HeadCache()
    head.eval()
    with torch.inference_mode():
        if prefix > 1:
            head.extend(cache, features[:-1], ids[:-1])  # P - 1 positions cached
        head.draft(cache, features[-1:], ids[-1:], 1)  # warm-up: first calls allocate
        cache.crop(prefix - 1)
        runs = []
        for _ in range(repeats):
            start = clock()
            head.draft(cache, features[-1:], ids[-1:], tokens)  # `tokens` head forwards
            runs.append((clock() - start) / tokens)
            cache.crop(prefix - 1)
    return 1000 * min(runs)


def head_ms_per_token(loaded: LoadedHead, cache_dir: Path | None = None) -> float:
    """Measured ms per token `loaded` drafts (cached in `cache_dir` per head and machine, spot-checked as the
    runners' timings are: specdec.runtime.profile)."""
    return float(_cached("head-draft", _Timed(loaded), {"tokens": 8, "repeats": CONTROL_REPEATS},
                         lambda: measure_head(loaded.head, tokens=8, repeats=CONTROL_REPEATS), cache_dir,
                         lambda cached: agrees(cached, measure_head(loaded.head, tokens=2, repeats=SPOT_REPEATS))))


class _Timed:
    """What a head's timings depend on, as specdec.runtime.profile keys a runner's (identity())."""

    def __init__(self, loaded: LoadedHead) -> None:
        self.loaded = loaded

    def identity(self) -> dict[str, Any]:
        return {"backend": f"head-{type(self.loaded.head).__name__}", "model": self.loaded.manifest["weights_sha256"],
                "threads": torch.get_num_threads()}


def describe(head: Any) -> str:
    """How a head runs: a FastHead says so; a DraftHead is the fp32 transformers layer."""
    return head.describe() if isinstance(head, FastHead) else "fp32 (transformers layer)"


def head_cost(head: DraftHead | FastHead, target: ModelRunner, tokens: int = 8, prefix: int = 128,
              repeats: int = 3, target_ms: float | None = None,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """ms per drafted token of `head` (`tokens` drafted in a row after `prefix` cached positions, the fastest
    of `repeats` runs), the target's one-token step after `prefix` tokens (measured unless `target_ms` is
    given) and their ratio, with how the head runs and its draft vocabulary."""
    if tokens < 1 or prefix < 1 or repeats < 1:
        raise ValueError("tokens, prefix and repeats must be >= 1")
    if target_ms is None:
        target_ms = measure_forwards(target, [1], prefix=min(prefix, target.max_context - 2), repeats=repeats).ms[1]
    ms = measure_head(head, tokens, prefix, repeats, clock)
    hidden = int(head.config.hidden_size)
    return {"head": describe(head), "draft_vocab": len(head.vocab), "hidden_size": hidden, "prefix": prefix,
            "tokens": tokens, "repeats": repeats, "ms_per_token": round(ms, 3),
            "target_step_ms": round(target_ms, 3), "ratio": round(ms / target_ms, 4)}


def split_head_spec(draft: str | None) -> tuple[str | None, str | None]:
    """A profile's --draft -> (the draft model spec for Engine.load or None, the head's directory or
    "" for the target's default one, or None when no head is named): head, head:<dir>, lookup+head...
    (specdec.drafters.spec.parse_drafter)."""
    from specdec.drafters.spec import parse_drafter

    head = parse_drafter(draft).head
    return (draft, None) if head is None else (None, head)


def head_for_profile(draft: str | None, target_name: str, model: Any,
                     dtype: str = "auto") -> tuple[FastHead, Path] | None:
    """The head `specdec profile` times (see the module doc), in its drafting form, with its directory; None
    when none is named and none is trained for the target (whatever other draft `draft` names).  A
    SpecdecError when a named one is missing or was trained for another target."""
    from specdec.head import store
    from specdec.head.manifest import has_head

    _, named = split_head_spec(draft)
    if named is None and not has_head(target_name):
        return None  # none named, none trained for the target
    directory = head_directory(named or "", target_name)
    head, _ = store.load(directory, model, target_name)
    return for_drafting(head, dtype), directory


def profile_head(draft: str | None, target_name: str, target: ModelRunner, prefix: int, repeats: int,
                 target_ms: float | None = None) -> dict[str, Any] | None:
    """`specdec profile`'s head report (head_cost with the head's directory), or None when no head is named
    or trained for the target, or a target runner without hidden states was not asked for one by name."""
    named = split_head_spec(draft)[1] is not None
    model = target.model
    if not target.capabilities.hidden_states or model is None:
        if named:
            raise SpecdecError(f"a draft head reads the target's hidden states, which a {target.describe()} "
                               "target does not give: profile it with --backend hf")
        return None
    found = head_for_profile(draft, target_name, model)
    if found is None:
        return None
    head, directory = found
    return {**head_cost(head, target, prefix=prefix, repeats=repeats, target_ms=target_ms), "directory": str(directory)}
