"""The target's features for head training: teacher-forced over text, or captured while it writes its own answers.

A head learns from pairs (f_t, x_{t+1}) and the next feature f_{t+1}, where f is the target's final
hidden state after its final norm (the LM head's input, what the runners' ``hidden()`` gives at
inference).  The target's next-token distribution at t+1 is its LM head applied to f_{t+1}, so the
features are all a training run has to keep: ``FeatureBank`` holds token ids [L] and features [L, H]
(fp16, half the memory) of every position produced so far, and cuts random training windows from them.
A head that fuses the target's intermediate layers (``taps``; specdec.head.model.DraftHead.fused) gets
those layers' outputs too, after the final feature: [L, H x (1 + taps)].

Two sources produce them, a chunk at a time, so that training can start before all data is there:

- ``TextSource``: token streams run through the target teacher-forced (its prefill: the cheapest way
  to get features; the LM head is not run);
- ``GenerationSource``: chat prompts the target answers greedily, in batches (left-padded), with the
  features of every fed position captured by a hook on the final norm while it generates: text that
  looks exactly like what the head will be asked to draft, at no extra pass.  (Medusa-2 and EAGLE-3 /
  HASS train on the target's own outputs for the same reason.)

The extractor may be a cheaper copy of the target: ``LeanExtractor``, specdec's own int8 runner
(specdec.native.lean, the target that drafts will serve: its features are exactly the inference-time
ones), which answers a batch of prompts with packed forwards (one [batch, hidden] matrix a decoding step)
and prefills text chunk by chunk; or a transformers model (``quantize_dynamic``'d int8 on a CPU where
specdec's kernel does not run, else the fp32 target).  Measured on a 2-core Zen 4 (AVX512-VNNI), 1.5B
target, chat prompts of ~170 tokens answered with up to 128 tokens, batches of 16: 91 positions a second
on the lean runner against 51 with ``generate`` on the ``quantize_dynamic`` copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Chunk(NamedTuple):
    """A produced stream: token ids [L], their features [L, H], and where the target's own answer begins
    (the first answer token's position; L where the stream holds no answer: teacher-forced text)."""

    ids: list[int]
    features: torch.Tensor
    start: int


def features(extractor: PreTrainedModel | LeanExtractor, ids: torch.Tensor, taps: Sequence[int] = ()) -> torch.Tensor:
    """Teacher-forced features of ids [B, T] -> [B, T, F] fp32: the decoder's post-norm output [.., H] (no LM
    head), then the outputs of the `taps` layers (0-based; the residual stream after each, before any norm),
    F = H x (1 + len(taps))."""
    if isinstance(extractor, LeanExtractor):
        return torch.stack([extractor.features(row.tolist(), taps) for row in ids])
    with torch.no_grad():
        out = extractor.get_decoder()(input_ids=ids, output_hidden_states=bool(taps))
    # hidden_states[0] is the embeddings' output, hidden_states[i + 1] layer i's
    return torch.cat([out.last_hidden_state, *(out.hidden_states[i + 1] for i in taps)], dim=-1).float()


def parse_taps(text: str, layers: int) -> tuple[int, ...]:
    """`--fuse-layers`' value for a target of `layers` decoder layers -> the tapped layers: "none" (the final
    feature alone), "auto" (:func:`default_taps`) or a comma-separated list of 0-based layer indices; a
    ValueError naming what is wrong else."""
    value = text.strip().lower()
    if value in ("none", "off", ""):
        return ()
    if value == "auto":
        return default_taps(layers)
    try:
        taps = [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"--fuse-layers takes auto, none or layer indices such as 2,14; got {text!r}") from None
    return check_taps(taps, layers)


def default_taps(layers: int) -> tuple[int, ...]:
    """The layers a fused head reads besides the final one: a low and a middle layer, EAGLE-3's choice
    (its high layer is the final feature here); none for a target of fewer than 8 layers."""
    return (2, layers // 2) if layers >= 8 else ()


def check_taps(taps: Sequence[int], layers: int) -> tuple[int, ...]:
    """The tapped layers as a tuple, or a ValueError: each in [0, layers - 1) (the last layer's output is the
    final feature's input already), ascending, no repeats."""
    taps = tuple(int(i) for i in taps)
    if list(taps) != sorted(set(taps)) or any(not 0 <= i < layers - 1 for i in taps):
        raise ValueError(f"tapped layers must ascend within [0, {layers - 1}), got {taps}")
    return taps


class LeanExtractor:
    """The target's int8 lean runner as a feature source (see the module docstring): ``features`` over a
    token stream, ``answer`` a batch of prompts greedily with every fed position's feature."""

    def __init__(self, runner: Any, batch: int = 16) -> None:
        self.runners = [runner] + [runner.clone() for _ in range(batch - 1)]  # one cache each, shared weights

    def tap(self, taps: Sequence[int]) -> None:
        """Every runner's rows from now on: the final feature, then these layers' outputs (LeanRunner.tap_layers)."""
        for runner in self.runners:
            runner.tap_layers(taps)

    def features(self, ids: Sequence[int], taps: Sequence[int] = ()) -> torch.Tensor:
        """ids [L] -> the target's features [L, F] fp32 (a prefill; the LM head over the last row only; F as
        :func:`features`).  A stream longer than the target's window is read in pieces of the window, each
        from an empty cache (as TextSource's chunks are)."""
        self.tap(taps)
        runner, ids = self.runners[0], list(ids)
        window = runner.max_context
        pieces = []
        try:
            for start in range(0, len(ids), window):
                piece = ids[start: start + window]
                runner.reset()
                runner.keep_hidden_rows(len(piece))
                runner.forward(piece, last_n=1)
                pieces.append(runner.hidden_tail().clone())  # [len(piece), H]
        finally:
            runner.keep_hidden_rows(0)
            runner.reset()
        return torch.cat(pieces)  # [L, H]

    def answer(self, prompts: Sequence[Sequence[int]], eos: set[int], max_new_tokens: int,
               taps: Sequence[int] = ()) -> list[Chunk]:
        """Answer `prompts` greedily, len(self.runners) at a time, up to max_new_tokens each (ending after the
        first end-of-sequence token, or where the target's window is full) -> (prompt + answer ids, their
        features [L, F]) each, every fed position's."""
        from specdec.native.lean import forward_packed

        self.tap(taps)
        out: list[Chunk] = []
        window = self.runners[0].max_context  # a prompt keeps its last window - 1 tokens, an answer the rest
        for start in range(0, len(prompts), len(self.runners)):
            group = [list(p)[-(window - 1):] for p in prompts[start: start + len(self.runners)]]
            runners = self.runners[: len(group)]
            for runner, prompt in zip(runners, group):
                runner.reset()
                runner.keep_hidden_rows(len(prompt))
            logits = forward_packed(runners, group, [1] * len(group))  # one packed prefill
            fed = [[r.hidden_tail().clone()] for r in runners]  # per prompt [[P, H], then [1, H] a step]
            for runner in runners:
                runner.keep_hidden_rows(0)
            streams = [list(p) for p in group]
            live = list(range(len(group)))
            for step in range(max_new_tokens):
                tokens = [int(row[-1].argmax()) for row in logits]  # greedy, one per live prompt
                for b, token in zip(live, tokens):
                    streams[b].append(token)
                going = [(b, t) for b, t in zip(live, tokens) if t not in eos and len(streams[b]) <= window]
                if not going or step + 1 == max_new_tokens:
                    break  # the last token is never fed: it has no feature
                live = [b for b, _ in going]
                logits = forward_packed([runners[b] for b in live], [[t] for _, t in going], [1] * len(live))
                for b in live:
                    fed[b].append(runners[b].hidden())
            for b, stream in enumerate(streams):
                feats = torch.cat(fed[b])  # [L, H]: every fed position
                out.append(Chunk(stream[: len(feats)], feats, min(len(group[b]), len(feats))))
            for runner in runners:
                runner.reset()
        return out


class FeatureBank:
    """Every produced position's token id, feature and whether it is an answer token (the target's own
    output, where a head drafts), one after another; training windows cut from them."""

    def __init__(self, hidden: int, dtype: torch.dtype = torch.float16) -> None:
        self.ids = torch.zeros(0, dtype=torch.long)  # [L]
        self.features = torch.zeros(0, hidden, dtype=dtype)  # [L, H]
        self.answer = torch.zeros(0, dtype=torch.bool)  # [L]
        self.length = 0

    def add(self, ids: Sequence[int], feats: torch.Tensor, start: int | None = None) -> None:
        """Append a stream's ids [n] and features [n, H], its answer from position `start` on (None: none)."""
        n = len(ids)
        if feats.shape != (n, self.features.shape[1]):
            raise ValueError(f"features {tuple(feats.shape)} for {n} positions; this bank holds [n, {self.features.shape[1]}]")
        if self.length + n > len(self.ids):  # grow by doubling
            size = max(2 * len(self.ids), self.length + n, 4096)
            grown_ids = torch.zeros(size, dtype=torch.long)
            grown = torch.zeros(size, self.features.shape[1], dtype=self.features.dtype)
            grown_answer = torch.zeros(size, dtype=torch.bool)
            grown_ids[: self.length], grown[: self.length] = self.ids[: self.length], self.features[: self.length]
            grown_answer[: self.length] = self.answer[: self.length]
            self.ids, self.features, self.answer = grown_ids, grown, grown_answer
        self.ids[self.length: self.length + n] = torch.as_tensor(ids, dtype=torch.long)
        self.features[self.length: self.length + n] = feats.to(self.features.dtype)
        if start is not None and start < n:
            self.answer[self.length + start: self.length + n] = True
        self.length += n

    def windows(self, count: int, window: int, generator: torch.Generator,
                focus: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`count` random windows of window + 1 positions -> (ids [B, T+1], features [B, T+1, H] fp32, answer
        [B, T+1] bool).  A `focus` share of them (drawn per window) holds an answer position drawn uniformly
        among all, at a uniformly drawn place in the window: training spends that share on what is drafted."""
        last = self.length - window - 1  # the last possible start
        starts = torch.randint(0, last + 1, (count,), generator=generator)  # [B]
        answers = self.answer[: self.length].nonzero().flatten() if focus > 0 else None  # [A]: answer positions
        if answers is not None and len(answers):
            chosen = torch.rand(count, generator=generator) < focus  # [B]
            picked = answers[torch.randint(0, len(answers), (count,), generator=generator)]  # [B]
            offset = torch.randint(0, window + 1, (count,), generator=generator)  # [B]
            starts = torch.where(chosen, (picked - offset).clamp(0, last), starts)
        index = starts[:, None] + torch.arange(window + 1)  # [B, T+1]
        return self.ids[index], self.features[index].float(), self.answer[index]


class Source(Protocol):
    """Where a run's features come from, and how far it got (``consumed``) and to start there
    (``skip(count)``), so that a resumed run (specdec.training.train.train's `head`) learns from material the
    run before did not reach."""

    def produce(self) -> list[Chunk]:
        """The next chunk(s) of (ids, features); [] when exhausted."""
        ...

    def tokens(self) -> list[int]:
        """The token ids known before producing (for the draft vocabulary's counts)."""
        ...

    @property
    def consumed(self) -> int:
        """How far it got: what a resumed run skips."""
        ...

    def skip(self, count: int) -> None:
        """Start where a run that consumed `count` stopped (call before producing)."""
        ...


class TextSource:
    """Token streams run through the extractor teacher-forced, `chunk` tokens at a time."""

    def __init__(self, extractor: PreTrainedModel | LeanExtractor, streams: Sequence[Sequence[int]], chunk: int = 512,
                 taps: Sequence[int] = ()) -> None:
        self.extractor, self.chunk, self.taps = extractor, chunk, tuple(taps)
        self.pieces = [list(s[i: i + chunk]) for s in streams for i in range(0, len(s), chunk) if len(s[i: i + chunk]) > 1]
        self.next = 0

    def produce(self) -> list[Chunk]:
        if self.next >= len(self.pieces):
            return []
        piece = self.pieces[self.next]
        self.next += 1
        return [Chunk(piece, features(self.extractor, torch.tensor([piece]), self.taps)[0], len(piece))]

    def tokens(self) -> list[int]:
        return [t for piece in self.pieces for t in piece]

    @property
    def consumed(self) -> int:
        """Pieces produced so far: where a run resumed after this one starts (:meth:`skip`)."""
        return self.next

    def skip(self, count: int) -> None:
        """Start at piece `count` (a resumed run: the run before produced those), past the end from the
        start again."""
        self.next = count % len(self.pieces) if self.pieces else 0


class GenerationSource:
    """Prompts (token ids, chat template applied) answered greedily by the extractor, `batch` at a time,
    up to `max_new_tokens` each; yields prompt + answer (cut after the first end-of-sequence token)
    with the features captured during generation.

    `follow_up(i, answer ids)`, where given, is called after prompt i (its index in `prompts`) is
    answered; the prompt ids it returns (a chat that goes on, a prompt quoting the answer), if any, are
    answered next, before the remaining prompts."""

    def __init__(self, extractor: PreTrainedModel | LeanExtractor, prompts: Sequence[Sequence[int]], eos_ids: Sequence[int],
                 pad_id: int, max_new_tokens: int = 128, batch: int = 16,
                 follow_up: Callable[[int, list[int]], list[int] | None] | None = None,
                 taps: Sequence[int] = ()) -> None:
        self.extractor, self.eos, self.pad, self.taps = extractor, set(eos_ids), pad_id, tuple(taps)
        self.max_new_tokens, self.batch, self.follow_up = max_new_tokens, batch, follow_up
        block = 8 * batch  # prompts sorted by length within blocks: less padding in a batch
        listed = [(list(p), i) for i, p in enumerate(prompts)]
        queue = [item for i in range(0, len(listed), block) for item in sorted(listed[i: i + block], key=lambda x: len(x[0]))]
        self.prompts = [p for p, _ in queue]
        self.keys: list[int | None] = [i for _, i in queue]  # each queued prompt's index in `prompts` (None: a follow-up)
        self.next = 0

    def tokens(self) -> list[int]:
        return [t for p in self.prompts for t in p]

    @property
    def consumed(self) -> int:
        """The given prompts answered so far (follow-ups not counted): where a run resumed after this one
        starts (:meth:`skip`)."""
        return sum(key is not None for key in self.keys[: self.next])

    def skip(self, count: int) -> None:
        """Start after the first `count` given prompts of the queue (a resumed run: the run before answered
        them, and their follow-ups), past the end from the start again.  Call before producing."""
        given = sum(key is not None for key in self.keys)
        count = count % given if given else 0
        at = 0
        while count:
            count -= self.keys[at] is not None
            at += 1
        self.next = at

    def produce(self) -> list[Chunk]:
        group, keys = self.prompts[self.next: self.next + self.batch], self.keys[self.next: self.next + self.batch]
        self.next += len(group)
        chunks = self.answer(group) if group else []
        if self.follow_up is not None:
            asked = [self.follow_up(key, ids[len(prompt):]) for prompt, key, (ids, _, _) in zip(group, keys, chunks)
                     if key is not None]
            more = [p for p in asked if p]
            self.prompts[self.next: self.next] = more
            self.keys[self.next: self.next] = [None] * len(more)
        return chunks

    def answer(self, group: list[list[int]]) -> list[Chunk]:
        """Generate for one batch of prompts; (prompt + answer ids, their features) each."""
        if isinstance(self.extractor, LeanExtractor):
            return self.extractor.answer(group, self.eos, self.max_new_tokens, self.taps)
        width = max(map(len, group))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in group])  # [B, P], left-padded
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in group])[:, None]).long()
        decoder = self.extractor.get_decoder()
        captured: list[list[torch.Tensor]] = [[] for _ in range(1 + len(self.taps))]  # per module, per forward [B, T, H]

        def keep(into: list[torch.Tensor]) -> Callable[..., None]:
            return lambda _m, _i, out: into.append((out[0] if isinstance(out, tuple) else out).float())

        hooks = [decoder.norm.register_forward_hook(keep(captured[0]))]
        hooks += [decoder.layers[i].register_forward_hook(keep(into)) for i, into in zip(self.taps, captured[1:])]
        try:
            with torch.no_grad():
                # (transformers types PreTrainedModel without generate(), which a causal LM has: GenerationMixin)
                out = self.extractor.generate(  # type: ignore[operator]
                    input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens, do_sample=False,
                    pad_token_id=self.pad, eos_token_id=sorted(self.eos) or None)
        finally:
            for hook in hooks:
                hook.remove()
        fed = torch.cat([torch.cat(c, dim=1) for c in captured], dim=2)  # [B, P + steps, F]: every fed position's
        chunks = []
        for b, prompt in enumerate(group):
            answer = out[b, width:].tolist()
            end = next((i + 1 for i, t in enumerate(answer) if t in self.eos), len(answer))
            stream = prompt + answer[:end]
            start = width - len(prompt)
            kept = min(len(stream), fed.shape[1] - start)  # the last generated token was never fed
            chunks.append(Chunk(stream[:kept], fed[b, start: start + kept], min(len(prompt), kept)))
        return chunks
