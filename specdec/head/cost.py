"""What a draft head costs per drafted token, against its target's one-token step (`specdec profile`).

Issue 38 asks a head to cost at most 0.08 of the int8 target's one-token step.  A drafted token is one
forward of the head over its own cache (specdec.head.model / specdec.head.fast); :func:`head_cost` times
`tokens` of them in a row after `prefix` positions in the head's cache, the fastest of `repeats` runs (as
specdec.runtime.profile.measure_drafting does for a draft model: what else the machine does only slows a run),
and the target's one-token step after the same prefix (specdec.runtime.profile.measure_forwards), and reports
their ratio.  The features fed are random: a forward's cost does not depend on their values.

:func:`head_for_profile` finds and loads the head `specdec profile` reports on: ``--draft head`` /
``head:<dir>`` (alone or behind ``lookup+``), or, with no draft given, the head trained for the target if
there is one (specdec.head.store.default_directory).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.backends.base import ModelRunner
from specdec.errors import SpecdecError
from specdec.head.fast import FastHead, for_drafting
from specdec.head.model import DraftHead
from specdec.head.use import head_directory, measure_head
from specdec.runtime.profile import measure_forwards


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
