"""The ModelRunner protocol: one model with a KV cache that can be rolled back.

A runner holds exactly the tokens its cache holds (``tokens``).  ``forward``
appends new tokens and returns the logits at each new position; ``rollback``
drops cached tokens from the end, which is how rejected draft tokens are
forgotten (as in gpt-fast, rollback is moving a position pointer).

Besides computing, a runner says what its callers need to know of it: the
end-of-sequence ids its model names (``eos_token_ids``), the transformers model
it computes where there is one (``model``), another runner over the same loaded
model (``clone``, a draft per batch slot), the backend in a few words for the
user (``describe``), and what its timings depend on (``identity``, the key of
cached step timings in :mod:`specdec.runtime.profile`).  Callers ask these instead of
probing a runner's attributes.

The protocol holds every method a caller may ask of a runner; what only some
runners can do, their ``capabilities`` say, once, when the runner is built, and
a runner without one inherits a one-line refusal (:class:`Refusals`).  A runner
whose capabilities say ``hidden_states`` hands out, after each forward, the
final hidden states of the positions whose logits it returned (``hidden``):
what a draft head reads, kept from the same forward at no extra cost.  Asked to
(``keep_hidden_rows``), it also keeps those of a forward's last few rows whose
logits it did not return (``hidden_tail``: a prompt's end, after a prefill that
returns one row), at the cost of the final norm of those rows; the output layer
never runs on them.  One whose capabilities say ``taps`` also keeps chosen
decoder layers' outputs with those rows (``tap_layers``), and one whose
capabilities say ``tree`` verifies a token tree in one forward
(``forward_tree`` / ``keep_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

if TYPE_CHECKING:  # torch types the protocols here; what checks a spec imports this module without it
    import torch

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the decode loop refuses clearly what it cannot."""

    rollback: bool = True  # can drop cached tokens from the end (the decode loop drafts only then)
    logits_all_positions: bool = True  # forward returns logits for every new token
    # A token's logits are bitwise the same whether it is evaluated alone or inside a
    # forward of several tokens, so verifying a draft in one forward is exact.
    batch_invariant: bool = False
    # hidden() / hidden_tail() give the last forward's final hidden states
    hidden_states: bool = False
    # tap_layers(layers) keeps those decoder layers' outputs with the hidden rows (a fused-feature draft head's)
    taps: bool = False
    # forward_tree / keep_rows verify a token tree in one forward
    tree: bool = False
    # draft_greedy(feed, k) feeds tokens and drafts k greedy ones in one native call (a draft model's chain)
    draft_chain: bool = False
    # trim_head(ids) / extend_head(extra) compute logits over some vocabulary ids only, head_ids naming them
    # (a draft's trimmed vocabulary: TrimmableHead)
    trim_head: bool = False


@dataclass(frozen=True)
class Footprint:
    """What a runner's cache and forwards take in memory (a server prices a request with it: specdec.runtime.memory).

    cache_bytes_per_token: the KV cache's bytes per cached token (layers x kv heads x head dim x 2 x the bytes
    of its element); row_bytes: the activations one row of a forward keeps alive at once, at most; logits_row_bytes:
    one row of fp32 logits (vocab x 4); chunked: a long prompt's prefill runs in forwards of at most
    PREFILL_CHUNK rows (forward_chunked) rather than in one.  All 0 for a runner whose memory is allocated once,
    when it is loaded (llama.cpp's context), or that keeps none of its own (a stairs view)."""

    cache_bytes_per_token: int = 0
    row_bytes: int = 0
    logits_row_bytes: int = 0
    chunked: bool = True


def decoder_footprint(layers: int, kv_heads: int, head_dim: int, heads: int, hidden: int, intermediate: int,
                      vocab: int, cache_element: int, element: int = 4, chunked: bool = True) -> Footprint:
    """A decoder's Footprint from its shapes: the cache `cache_element` bytes an element, activations `element`
    bytes.  A row's activations: the residual stream and its norm, the attention's output and the layer's
    output (4 x hidden, plus 2 x hidden for a kept or quantized copy), q, k and v, and the MLP's gate, up and
    activated product (3 x intermediate, plus one for its quantized input)."""
    row = 6 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 4 * intermediate
    return Footprint(cache_bytes_per_token=layers * kv_heads * head_dim * 2 * cache_element, row_bytes=row * element,
                     logits_row_bytes=vocab * 4, chunked=chunked)


@runtime_checkable
class ModelRunner(Protocol):
    tokens: list[int]  # exactly what the KV cache holds, in order
    capabilities: Capabilities
    vocab_size: int  # width V of the logits (the token ids it embeds; see logit_ids for a trimmed head)
    max_context: int  # the most tokens the cache may hold
    @property
    def model(self) -> Any:
        """The transformers model it computes (shared by its clones), or None (llama.cpp, stairs, ...)."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's own end-of-sequence ids (the engine adds the tokenizer's)."""
        ...

    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        """Append `new_tokens` to the cache; return fp32 logits [n, V] for the last n of them
        (n = last_n, or all of them when last_n is None)."""
        ...

    def rollback(self, n: int) -> None:
        """Keep only the first n cached tokens."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...

    def clone(self) -> ModelRunner:
        """Another runner over the same loaded model with an empty cache of its own (a draft per batch
        slot), or a SpecdecError (:func:`cannot_clone`) where the model cannot be shared."""
        ...

    def describe(self) -> str:
        """The backend in a few words, as the CLI names it: "transformers", "transformers int8",
        "specdec int4", "llama.cpp"."""
        ...

    def footprint(self) -> Footprint:
        """What its cache and its forwards take in memory, per cached token and per row (Footprint)."""
        ...

    def expect(self, tokens: int) -> None:
        """A request will cache at most about `tokens` tokens (its prompt, its max_tokens, a draft): a runner
        that preallocates its cache makes room for exactly that many now (capped at max_context) instead of
        growing it by doubling; the others do nothing.  A hint: more tokens still fit, fewer waste nothing
        but address space."""
        ...

    def trim(self, tokens: int) -> int:
        """Keep at most the first `tokens` cached tokens (what prefix reuse may still use) and free the cache's
        room past them; returns about how many bytes it let go (0 where nothing was freed)."""
        ...

    def identity(self) -> dict[str, Any]:
        """What its timings depend on, as JSON values: at least "backend", "model" (its name or path;
        "" when it has none, and then nothing is cached) and "threads"."""
        ...

    def hidden(self) -> torch.Tensor:
        """Where capabilities say hidden_states: the final hidden states of the positions whose logits the
        last forward returned: fp32 [n, H], row i for logits row i.  Final means the input of the model's
        output layer (its LM head) at those positions: after the model's final norm, and after any scaling a
        model applies before its head (T5's d_model ** -0.5 where its config says scale_decoder_outputs), so
        the head applied to them gives the logits (plus a final bias or softcapping where a model adds one after its head).  Kept
        from the forward itself (no extra computation); a RuntimeError before the first forward and after
        reset.  Rollback keeps them: they are the last forward's, whatever was dropped since."""
        ...

    def keep_hidden_rows(self, n: int) -> None:
        """From now on (until changed; reset keeps it) each forward keeps the final hidden states of its last
        n new rows as well as those of its logits, for hidden_tail.  0 (the default): only the logits' rows.
        Costs at most the final norm of the extra rows; the logits and hidden() are bitwise unchanged."""
        ...

    def hidden_tail(self) -> torch.Tensor:
        """The final hidden states of the last rows of the last forward, fp32 [m, H]: m = max(rows of
        hidden(), min(n, new rows)) for n of keep_hidden_rows, so its last rows are hidden()'s (a runner
        that cannot keep more, Seq2SeqRunner, gives hidden()'s).  Row i is of position L - m + i, L the
        tokens cached right after that forward.  Rollback keeps them; a RuntimeError where hidden() has one."""
        ...

    def tap_layers(self, layers: Sequence[int]) -> None:
        """Where capabilities say taps: from the next forward on, every row of hidden() and hidden_tail()
        carries, after the final hidden state, the outputs of these decoder layers (0-based, the residual
        stream after each, before any norm): [n, H x (1 + len(layers))], what a fused-feature draft head
        reads (specdec.head.model.DraftHead.fused); () turns it off."""
        ...

    def forward_tree(self, new_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Where capabilities say tree (SpecInfer, Miao et al. 2024, arXiv 2305.09781: tree attention;
        issue 39): append a tree of n new tokens: parents[i] < i is the new token that token i follows, -1
        for one that follows the last cached token.  Token i sits at position (cached + its depth), depth 0 for a
        parent of -1, and attends to the cached tokens and to its ancestors and itself only.  Returns fp32
        logits [n, V]; row i is bitwise what a chain forward over token i's path would give it where
        the runner is batch_invariant.  Until keep_rows, `tokens` holds the cached tokens and then all n
        new ones in the order given (not a sequence): call keep_rows before any other forward.  A
        hidden_states runner's hidden() and hidden_tail() are then the n nodes' rows [n, H], row i of token i."""
        ...

    def keep_rows(self, cached: int, rows: Sequence[int]) -> None:
        """After forward_tree over a cache of `cached` tokens: keep those and the new tokens `rows` (indices
        into that forward's new tokens; a root-to-node path, in order), in that order; drop the rest.  The
        cache is then what a chain forward over the path would have left, and so are hidden() and
        hidden_tail(): the kept rows' [len(rows), H]."""
        ...

    def draft_greedy(self, feed: Sequence[int], k: int) -> list[int]:
        """Where capabilities say draft_chain (a draft model's chain in one native call): feed `feed`, then
        k tokens, each the argmax of the last row's logits and the next one's input, as forward() and an
        argmax would give them one at a time; the cache then holds feed and the first k - 1 (the last is
        not fed)."""
        ...


class Refusals:
    """The protocol's methods that only some runners offer, as a runner whose capabilities do not say so
    has them: each refuses in one line.  A runner that offers one (its capabilities say so) overrides it."""

    def hidden(self) -> torch.Tensor:
        raise refused(self, "gives no hidden states")

    def keep_hidden_rows(self, n: int) -> None:
        raise refused(self, "gives no hidden states")

    def hidden_tail(self) -> torch.Tensor:
        raise refused(self, "gives no hidden states")

    def tap_layers(self, layers: Sequence[int]) -> None:
        raise refused(self, "keeps no intermediate layers' rows")

    def forward_tree(self, new_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        raise refused(self, "cannot verify a token tree")

    def keep_rows(self, cached: int, rows: Sequence[int]) -> None:
        raise refused(self, "cannot verify a token tree")

    def draft_greedy(self, feed: Sequence[int], k: int) -> list[int]:
        raise refused(self, "drafts no chain in one call")


def refused(runner: object, what: str) -> SpecdecError:
    """The one-line error of a runner asked for what its capabilities do not offer."""
    return SpecdecError(f"a {type(runner).__name__} {what}")


def checked_taps(layers: Sequence[int], count: int) -> tuple[int, ...]:
    """tap_layers' argument as a tuple of layer indices, or a ValueError for one outside [0, count)."""
    taps = tuple(int(i) for i in layers)
    if any(not 0 <= i < count for i in taps):
        raise ValueError(f"tapped layers must be in [0, {count}), got {taps}")
    return taps


def last_hidden(hidden: torch.Tensor | None, runner: object) -> torch.Tensor:
    """A runner's kept hidden states [n, H] as ModelRunner.hidden returns them (fp32, on the CPU), or
    the RuntimeError of a runner that has run no forward since it was built or reset."""
    if hidden is None:
        raise RuntimeError(f"{type(runner).__name__}.hidden(): no hidden states kept "
                           "(no forward since it was built or reset)")
    return hidden.float().cpu()  # [n, H]


class KeptHidden:
    """ModelRunner's hidden(), keep_hidden_rows() and hidden_tail() for a runner that keeps its last forward's
    final hidden states (the final norm's output, the output layer's input) in `_hidden` (the logits' rows)
    and `_tail` (its last rows, `_hidden` their end), and reads how many rows to keep from `hidden_rows`:
    HFRunner's and LeanRunner's (and so the gguf runner's), whose forwards set all three."""

    _hidden: torch.Tensor | None
    _tail: torch.Tensor | None
    hidden_rows: int

    def hidden(self) -> torch.Tensor:
        """The last forward's final hidden states [n, H] fp32 (ModelRunner.hidden)."""
        return last_hidden(self._hidden, self)

    def keep_hidden_rows(self, n: int) -> None:
        """Keep the final hidden states of each forward's last n rows too (ModelRunner.keep_hidden_rows)."""
        self.hidden_rows = max(0, int(n))

    def hidden_tail(self) -> torch.Tensor:
        """The last forward's final hidden states of its last rows [m, H] fp32 (ModelRunner.hidden_tail)."""
        return last_hidden(self._tail, self)


def cannot_clone(runner: object) -> SpecdecError:
    """The error of a runner whose model cannot back another cache (ModelRunner.clone)."""
    return SpecdecError(
        f"batched decoding gives each request a draft cache of its own, which a {type(runner).__name__} draft "
        "cannot share its model with: draft with prompt lookup (--draft lookup) or a transformers draft"
    )


def checked_new_tokens(new_tokens: Sequence[int], cached: int, max_context: int, what: str = "tokens") -> list[int]:
    """`new_tokens` as a list, after the checks every forward makes: at least one token, and the
    `cached` tokens plus the new ones within the model's window (a one-line SpecdecError)."""
    new_tokens = list(new_tokens)
    if not new_tokens:
        raise ValueError("forward needs at least one token")
    if cached + len(new_tokens) > max_context:
        raise SpecdecError(
            f"context of {cached + len(new_tokens)} {what} exceeds the model's window of {max_context}"
        )
    return new_tokens


class TrimmableHead(Protocol):
    """What a runner whose capabilities say trim_head offers (specdec.native.lean.LeanRunner: a draft's head over
    a trimmed vocabulary, FR-Spec; specdec.drafters.draft_vocab)."""

    head_ids: torch.Tensor | None  # [N]: the vocabulary id of each logits column (None: every id, [n, vocab_size])

    def trim_head(self, ids: torch.Tensor | None) -> None:
        """From the next forward on, logits over vocabulary ids `ids` [N] only (None: the whole vocabulary)."""
        ...

    def extend_head(self, extra: Sequence[int]) -> None:
        """A trimmed head's set and the ids `extra` outside it (a request's own), in place of any extra before."""
        ...


def trimmable(runner: ModelRunner) -> TrimmableHead | None:
    """`runner` as a TrimmableHead where its capabilities say trim_head, else None."""
    return cast(TrimmableHead, runner) if runner.capabilities.trim_head else None


def logit_ids(runner: ModelRunner) -> torch.Tensor | None:
    """The vocabulary ids [N] of the columns of `runner`'s logits where its head is trimmed to some of the
    vocabulary (a draft's: specdec.native.lean.LeanRunner.trim_head, specdec.drafters.draft_vocab), else None: the
    logits are [n, vocab_size], column i token i, as for every other runner."""
    head = trimmable(runner)
    return None if head is None else head.head_ids


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# Tokens a long prompt's prefill feeds per forward (forward_chunked): a forward's activations then grow with
# the chunk, not the prompt.  Measured on the 1.5B gguf target (Zen 4): prefill ran at the same speed in chunks
# of 256 to 4,096 tokens (2,048 tokens: 168-170 tok/s; 4,096: 141-148); in a batch (specdec.runtime.batching) each chunk
# is one round, so the other requests' decode steps go on between a long prompt's chunks.
PREFILL_CHUNK = 512


def forward_chunked(runner: ModelRunner, tokens: Sequence[int], last_n: int | None = 1,
                    chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """runner.forward(tokens, last_n), fed in forwards of at most `chunk` tokens where the runner is
    batch-invariant: the same logits and cache bit for bit (reusable_prefix relies on that too), with a
    forward's memory bounded by the chunk.  The last forward is a whole chunk, so rows a caller keeps of it
    (hidden_rows, last_n up to `chunk`) are all there.  Another runner takes the tokens in one forward."""
    tokens = list(tokens)
    if len(tokens) <= chunk or not runner.capabilities.batch_invariant or (last_n is None or last_n > chunk):
        return runner.forward(tokens, last_n=last_n)
    head = len(tokens) - chunk
    for start in range(0, head, chunk):
        runner.forward(tokens[start : min(start + chunk, head)], last_n=1)
    return runner.forward(tokens[head:], last_n=last_n)


def reusable_prefix(runner: ModelRunner, prompt: Sequence[int]) -> int:
    """How many of `prompt`'s first tokens a new generation may take from what `runner`'s cache already holds
    (a multi-turn conversation's earlier turns, a shared system prompt), leaving at least its last token to
    feed for the first logits: its common prefix with the cache, where the runner is batch-invariant and
    rolls back, else 0.  Batch invariance makes that exact: the cached rows and the logits after them are
    bitwise those of one prefill over the whole prompt, however the prompt was split into forwards; an fp32
    runner's would differ in rounding, so it prefills anew."""
    caps = runner.capabilities
    if not (caps.batch_invariant and caps.rollback) or not prompt:
        return 0
    return min(common_prefix_length(runner.tokens, prompt), len(prompt) - 1)

