"""Suffix drafting: model-free drafts from the request's own context and from recent requests' outputs.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; ArcticInference, now vLLM's ``suffix`` method)
drafts with no model at all: much of what a served model writes repeats what it, or another request,
wrote before (agent loops re-emit tool calls and file contents, code edits rewrite the last answer,
templated tasks repeat their structure).  It keeps a suffix tree over each request's prompt and one
over earlier requests' outputs, finds the longest match of the context's suffix in them, and proposes
the most frequent continuation of that match:

- **scoring**: a continuation token's probability is how often it followed the matched text, its count
  over the match's count (a path's: the count of match + path over the match's); the chain takes the
  most frequent child at each depth and stops where that probability falls below ``min_prob``; a
  chain's score is the sum of its tokens' probabilities (the expected number accepted, if the counts
  are the truth), and the source with the higher score (the request's own context or the store) drafts;
- **draft length adapted to the match**: at most ``spec_factor`` × the match's length, so a one-token
  match drafts at most two tokens and a long match a long draft (vLLM's default factor is 1; 2 bought
  4-7% more speed on the edit and agent workloads, replayed with plain's outputs);
- **grades** (:meth:`SuffixDrafter.grade`): each proposal is classed by its match's length and its first
  token's count, and the speculation controller (specdec.algorithm.control) learns an acceptance rate per class:
  the paper's score decides among candidates, the rate per class decides how many tokens to verify;
- **trees** (specdec.drafters.tree): the greedy chain first, then the most probable other continuation
  nodes (best first by probability), merged by :func:`specdec.drafters.tree.trie`.

Worked example, tokens "y", "=", "f(", "a", ")", ...; three earlier outputs "y = f( a )", "y = f( a )",
"y = f( b )" in the store; context "... z = f(", k = 4::

    longest match: "= f(" (2 tokens, three occurrences), followed by "a" twice and "b" once
    chain: "a" (2/3) ")" (2/3), score 4/3 (at most spec_factor · 2 = 4 tokens; the outputs end there)
    grade: "match 2-3 p>=.5" (a 2-token match, 2 of 3 occurrences agree on "a")
    tree (width 2): "a )" first, then "b" (1/3) and "b )" (1/3)

The index is not a suffix tree but an equivalent for these queries, sized for Python
(:class:`SuffixIndex`): each sequence is kept once in a flat array (sequences separated by a token no
model emits) and, beside it, for every position the latest earlier position that followed the same
``anchor``-token window (1 token in the request's own context, 2 in the shared store: a one-token match
among thousands of answers is noise), with a table from each window to its latest position.  A query
follows those links from the context's last window to its latest ``OCCURRENCES`` occurrences and
extends the match backwards one token at a time, keeping the occurrences that still agree, until none
does or ``max_depth`` tokens match: the survivors are the occurrences of the longest match, and their
continuations, grouped token by token, are the suffix tree's subtree under it with its counts.  The
store's memory is three words per token (the token, its link, a hash bucket: ~20 bytes, measured in
tests/drafters/test_suffix.py) instead of a suffix tree's nodes, and dropping the oldest output cuts
the arrays' front (links into it end there); counts are over the latest OCCURRENCES occurrences of the
window (recent text weighs more: the paper too keeps only recent requests).

**The shared store** (:class:`SuffixStore`, one per Engine: every request and batch slot of a server)
holds the outputs of recent requests, at most ``memory`` tokens (``--suffix-memory``; default
specdec.defaults.DEFAULT_SUFFIX_MEMORY), the oldest output evicted first; a lock makes it safe for the
server's worker threads.  Prompts are not stored (as in the paper): a request's own prompt is in its
own context, which every drafter indexes, and an agent's next prompt repeats the conversation anyway --
except each prompt's last ``STORE_LEAD`` tokens, kept just before its output (a chat template's
assistant header, typically): then the store knows how answers begin, and a request's first tokens,
whose context is the prompt alone, draft from the answers that followed the same header (an agent's
``{"tool": ...`` in a new session, a template's format).  An output enters the store when its request
ends (Engine: ``_steps``), also a cancelled one's, part way.

Drafts carry no probabilities (``q = None``): verified as deterministic proposals, exact under greedy
decoding, distribution-preserving under sampling.  A seeded sampled request drafts from its own
context only: its text then depends on its seed and tokens, not on what other requests wrote.

**ArcticInference, evaluated** (arctic-inference 0.3.0 on PyPI; Apache-2.0 by its LICENSE file and
SPDX headers): no wheel for this or any platform since 0.0.4 (0.0.1-0.0.4 are pure-Python wheels;
0.0.6-0.3.0 sdists only, 0.3.0's 226 kB), so ``pip download`` takes the sdist and starts building it
in an isolated environment whose requirements include torch >= 2.10, CMake, ninja, nanobind 2.9.2,
protobuf and grpcio-tools; the extension needs a C++20 compiler.  The suffix tree itself
(csrc/suffix_decoding: ~1,700 lines of C++ with nanobind bindings, a CMake project in C++ only)
needs no CUDA, and its Python module imports numpy and that extension only.  Its API
(``SuffixDecodingCache(max_tree_depth, max_cached_requests)``: start_request(req_id, prompt) /
add_active_response / stop_request / speculate(req_id, context, max_spec_tokens, max_spec_factor,
max_spec_offset, min_token_prob, use_tree_spec) -> token_ids, parents, probs, score, match_len)
bounds the store by a number of requests, not tokens.  So specdec carries this Python index instead
of a compiled optional dependency that most installs would have to build: the same queries (longest
match, frequency scoring, a match-capped length, trees) and a bound in tokens.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.algorithm.draft import SHORT_SUFFIX, SUFFIX, Draft, Drafter, match_grade
from specdec.defaults import DEFAULT_SUFFIX_MEMORY
from specdec.drafters.tree import tree_draft
from specdec.errors import SpecdecError

SEP = -1  # between sequences in an index's array: no model emits it, so no match crosses it
MAX_DEPTH = 24  # the longest match looked for, in tokens (vLLM's suffix_decoding_max_tree_depth)
OCCURRENCES = 256  # latest occurrences of the last window a query looks at: what its counts are over
SPEC_FACTOR = 2.0  # a draft is at most this many times the match's length (vLLM's max_spec_factor, default 1)
MIN_PROB = 0.1  # a draft token's estimated probability (count / the match's count) must reach this (vLLM's)
STORE_ANCHOR = 2  # the shortest match used in the shared store
STORE_LEAD = 8  # the prompt's last tokens kept before each output in the shared store (how answers begin)
HYBRID_MIN_SCORE = 1.0  # in a hybrid, suffix drafts go first when they expect this many tokens accepted


def window_key(window: Sequence[int]) -> int:
    """One int for a window of tokens (each < 2**32)."""
    key = 0
    for token in window:
        key = (key << 32) | token
    return key


def table_size(tokens: int) -> int:
    """Hash buckets for an index of up to `tokens` tokens: the power of two >= tokens (at least 1024)."""
    return 1 << max(10, (tokens - 1).bit_length())


class SuffixIndex:
    """Token sequences in one array, each after a SEP; for each position, the latest earlier position that
    followed the same `anchor`-token window (or a window of the same hash bucket), so that a window's
    occurrences are found latest first by following those links.  Positions are absolute: dropping the
    oldest sequence cuts the arrays' front and leaves every later position as it was.

    buckets: 0 for a dictionary from each window to its latest position (few windows: one request's
    context), else a hash table of that many buckets (a power of two: the store's memory stays
    two arrays and this table); a query checks every token it matches, so a bucket shared by two
    windows costs only some of the `occurrences` it looks at."""

    def __init__(self, anchor: int = 1, occurrences: int = OCCURRENCES, buckets: int = 0) -> None:
        if anchor < 1 or occurrences < 1 or buckets < 0 or buckets & (buckets - 1):
            raise ValueError(f"need anchor >= 1, occurrences >= 1 and buckets 0 or a power of two, got "
                             f"{anchor}, {occurrences}, {buckets}")
        self.anchor, self.occurrences = anchor, occurrences
        self._tokens = array("i")  # [n] the tokens from absolute position _base on
        self._previous = array("q")  # [n] the latest earlier position after the same window (bucket), or -1
        self._base = 0
        self._start = 0  # where the open sequence starts
        self._shift = 64 - max(buckets.bit_length() - 1, 0)
        self._heads: dict[int, int] | array = array("q", [-1]) * buckets if buckets else {}

    @property
    def end(self) -> int:
        """The absolute position after the last token."""
        return self._base + len(self._tokens)

    def _slot(self, window: Sequence[int]) -> int:
        """The window's key in the dictionary, or its bucket (a multiplicative hash's top bits)."""
        key = window_key(window)
        if isinstance(self._heads, dict):
            return key
        return ((key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> self._shift

    def _latest(self, slot: int) -> int:
        return self._heads.get(slot, -1) if isinstance(self._heads, dict) else self._heads[slot]

    def open(self) -> int:
        """Start a new sequence (a SEP, then its tokens); its first token's position."""
        self._tokens.append(SEP)
        self._previous.append(-1)
        self._start = self.end
        return self._start

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the open sequence, each linked to the latest earlier token after its window."""
        toks, a = self._tokens, self.anchor
        for token in tokens:
            if token < 0:
                raise ValueError(f"token ids are >= 0, got {token}")
            position = self.end
            toks.append(token)
            if position - a < self._start:
                self._previous.append(-1)  # no whole window before it in this sequence
                continue
            i = position - self._base
            slot = self._slot(toks[i - a:i])
            self._previous.append(self._latest(slot))
            self._heads[slot] = position

    def drop(self, start: int, end: int) -> None:
        """Forget the oldest sequence, tokens [start, end), with the SEP before it: links into it end there."""
        if start - 1 != self._base or not start <= end <= self.end:
            raise ValueError(f"only the oldest sequence can be dropped, not [{start}, {end})")
        del self._tokens[:end - self._base]
        del self._previous[:end - self._base]
        self._base = end

    def occurrences_of(self, window: Sequence[int]) -> list[int]:
        """The latest `occurrences` positions after `window` (or, in a hash table, after a window of its
        bucket), latest first."""
        found: list[int] = []
        position, previous, base = self._latest(self._slot(window)), self._previous, self._base
        while position >= base and len(found) < self.occurrences:
            found.append(position)
            position = previous[position - base]
        return found

    def match(self, context: Sequence[int], max_depth: int) -> tuple[int, list[int]]:
        """(n, positions): the longest n in anchor..max_depth such that the context's last n tokens occurred
        (within one sequence, followed by a token), and the positions of the tokens that followed those
        occurrences, latest first; (0, []) when not even the last `anchor` tokens did."""
        a = self.anchor
        if len(context) < a or max_depth < a:
            return 0, []
        toks, base, n, positions = self._tokens, self._base, 0, self.occurrences_of(context[-a:])
        while positions and n < min(max_depth, len(context)):
            want = context[-n - 1]  # a SEP before each sequence stops every occurrence there
            agree = [p for p in positions if toks[p - n - 1 - base] == want]
            if not agree and n >= a:
                break
            positions, n = agree, n + 1
        return (n, positions) if positions else (0, [])

    def children(self, positions: Sequence[int], depth: int) -> dict[int, list[int]]:
        """The continuations `depth` tokens after `positions`, grouped by token (positions kept in order);
        an occurrence whose sequence ends before that is left out."""
        toks, base = self._tokens, self._base
        groups: dict[int, list[int]] = {}
        for p in positions:
            i = p + depth - base
            if i < len(toks) and toks[i] != SEP:
                groups.setdefault(toks[i], []).append(p)
        return groups

    def continuation(self, context: Sequence[int], limit: int, max_depth: int, spec_factor: float,
                     min_prob: float, nodes: int = 0) -> Continuation:
        """The greedy chain after the longest match of `context` (at most `limit` tokens and spec_factor
        times the match's length) and, with `nodes`, the paths of up to that many most probable
        continuation nodes as tree branches."""
        length, positions = self.match(context, max_depth)
        limit = min(limit, int(spec_factor * length + 1e-9))
        if not positions or limit <= 0:
            return Continuation(length, [], [], [])
        chain, probs = greedy_chain(self, positions, limit, min_prob)
        branches = best_nodes(self, positions, limit, min_prob, nodes) if nodes > 0 else []
        return Continuation(length, chain, probs, branches)


@dataclass(frozen=True)
class Continuation:
    """A source's proposal for a context: the match's length, the greedy chain, its tokens' estimated
    probabilities (count / the match's count, non-increasing) and, for a tree, more branches (paths to
    the most probable nodes, best first)."""

    length: int
    chain: list[int]
    probs: list[float]
    branches: list[list[int]]

    @property
    def score(self) -> float:
        """The chain's expected accepted tokens under its counts: the sum of its probabilities."""
        return sum(self.probs)


NOTHING = Continuation(0, [], [], [])


def greedy_chain(index: SuffixIndex, positions: list[int], limit: int,
                 min_prob: float) -> tuple[list[int], list[float]]:
    """The most frequent continuation of the occurrences at `positions` (latest first), token by token (ties:
    the one seen last), while its probability (its count / len(positions)) stays >= min_prob, up to
    `limit` tokens."""
    total = len(positions)
    chain: list[int] = []
    probs: list[float] = []
    while len(chain) < limit:
        groups = index.children(positions, len(chain))
        if not groups:
            break
        token, positions = max(groups.items(), key=lambda group: (len(group[1]), group[1][0]))
        if len(positions) / total < min_prob:
            break
        chain.append(token)
        probs.append(len(positions) / total)
    return chain, probs


def best_nodes(index: SuffixIndex, positions: list[int], limit: int, min_prob: float, nodes: int) -> list[list[int]]:
    """Paths to the `nodes` most probable continuation nodes at most `limit` deep with a probability >=
    min_prob, best first (ties: the earlier found): a parent always before its children."""
    total, tick = len(positions), 0
    found: list[list[int]] = []
    heap: list[tuple[float, int, tuple[int, ...], list[int]]] = [(-1.0, 0, (), positions)]
    while heap and len(found) < nodes:
        _, _, path, group = heapq.heappop(heap)
        if path:
            found.append(list(path))
        if len(path) >= limit:
            continue
        for token, below in index.children(group, len(path)).items():
            if len(below) / total >= min_prob:
                tick += 1
                heapq.heappush(heap, (-len(below) / total, tick, (*path, token), below))
    return found


class SuffixStore:
    """Recent requests' outputs, shared by an engine's requests: at most `memory` tokens (0: none), the
    oldest output evicted first, an output longer than that kept by its last `memory` tokens.  Thread-safe:
    one lock around every change and every query (:meth:`continuation`)."""

    def __init__(self, memory: int = DEFAULT_SUFFIX_MEMORY, anchor: int = STORE_ANCHOR) -> None:
        if memory < 0:
            raise SpecdecError(f"the suffix store's memory must be >= 0 tokens, got {memory}")
        self.memory = memory
        self._index = SuffixIndex(anchor, buckets=table_size(memory))
        self._outputs: deque[tuple[int, int]] = deque()  # (start, end) of each output kept, oldest first
        self._size = 0  # tokens kept
        self.version = 0  # bumped at every change: a drafter's cached proposal is stale after one
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens kept (at most `memory`)."""
        return self._size

    def __len__(self) -> int:
        """Outputs kept."""
        return len(self._outputs)

    def add(self, tokens: Sequence[int], lead: Sequence[int] = ()) -> None:
        """Remember an output (evicting the oldest ones until it fits) after `lead`, the end of its prompt
        (its last STORE_LEAD tokens are kept; nothing for an empty output)."""
        if not tokens:
            return
        tokens = [*lead[-STORE_LEAD:], *tokens]
        tokens = tokens[-self.memory:] if self.memory else []
        if len(tokens) <= self._index.anchor:  # nothing follows any window of it
            return
        with self._lock:
            while self._outputs and self._size + len(tokens) > self.memory:
                start, end = self._outputs.popleft()
                self._index.drop(start, end)
                self._size -= end - start
            start = self._index.open()
            self._index.extend(tokens)
            self._outputs.append((start, self._index.end))
            self._size += len(tokens)
            self.version += 1

    def continuation(self, context: Sequence[int], limit: int, max_depth: int, spec_factor: float,
                     min_prob: float, nodes: int = 0) -> Continuation:
        """SuffixIndex.continuation over the store, under its lock."""
        with self._lock:
            return self._index.continuation(context, limit, max_depth, spec_factor, min_prob, nodes)


class SuffixDrafter(Drafter):
    """Proposes the most frequent continuation of the context's longest match in the request's own context
    or in `store` (recent outputs; None: the context only), whichever scores higher.

    min_ngram: the shortest match drafted from (the context's index uses it as its anchor; the store's
    is STORE_ANCHOR); min_score: the least score (expected accepted tokens) a proposal needs, else none
    (a hybrid's first source asks for HYBRID_MIN_SCORE; its :meth:`shorter` proposes the rest)."""

    source = SUFFIX

    def __init__(self, store: SuffixStore | None = None, min_ngram: int = 1, max_depth: int = MAX_DEPTH,
                 spec_factor: float = SPEC_FACTOR, min_prob: float = MIN_PROB, min_score: float = 0.0) -> None:
        if not 1 <= min_ngram <= max_depth:
            raise ValueError(f"need 1 <= min_ngram <= max_depth, got {min_ngram}, {max_depth}")
        if spec_factor <= 0 or not 0 <= min_prob <= 1:
            raise ValueError(f"need spec_factor > 0 and min_prob in [0, 1], got {spec_factor}, {min_prob}")
        self.store, self.min_ngram, self.max_depth = store, min_ngram, max_depth
        self.spec_factor, self.min_prob, self.min_score = spec_factor, min_prob, min_score
        self.reset()

    def reset(self) -> None:
        self._own = SuffixIndex(self.min_ngram)  # the request's context (prompt + output so far)
        self._own.open()
        self._seen: list[int] = []  # what _own holds
        self._memo: tuple[tuple, Continuation, str] | None = None  # (key, best chain, where) of the last query
        self.drafted_from = {"context": 0, "store": 0}  # proposals per index, this generation

    def _sync(self, context: Sequence[int]) -> None:
        """Index `context`: extend the own index when it continues what was seen, else rebuild it."""
        known = len(self._seen)
        if len(context) < known or list(context[:known]) != self._seen:
            self.reset()
            known = 0
        self._own.extend(context[known:])
        self._seen.extend(context[known:])

    def _best(self, context: Sequence[int]) -> tuple[Continuation, str]:
        """The better-scoring chain of the context's own index and the store's (at full length, cached
        until the context or the store changes), and where it came from: "context" or "store"."""
        key = (len(context), tuple(context[-2:]), self.store.version if self.store is not None else 0)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1], self._memo[2]
        self._sync(context)
        args = (self.max_depth, self.max_depth, self.spec_factor, self.min_prob)
        best, where = self._own.continuation(context, *args), "context"
        if self.store is not None:
            shared = self.store.continuation(context, *args)
            if shared.length >= self.min_ngram and shared.score > best.score:
                best, where = shared, "store"
        if best.score < self.min_score or best.length < self.min_ngram:
            best = NOTHING
        self._memo = (key, best, where)
        return best, where

    def matches(self, context: Sequence[int]) -> bool:
        """Whether a proposal for `context` would hold a token."""
        return bool(self._best(context)[0].chain)

    def grade(self, context: Sequence[int], source: str = SUFFIX) -> str | None:
        """The class of evidence behind the proposal for `context` (Drafter.grade), None for no
        proposal: the match's length in powers of two (1, 2-3, 4-7, 8-15, 16+ tokens) and how sure the
        counts are of its first token (all occurrences agree, at least half, fewer).  On the edit and
        agent workloads a first token after a 16+ token match was right 98% of the time, after a 1-3
        token match that all occurrences agree on 50-76%, after one that fewer than half do 5-10%: the
        controller learns each class's rate and drafts each accordingly."""
        best = self._best(context)[0]
        return match_grade(best.length, best.probs[0]) if best.chain else None

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Draft:
        best, where = self._best(context)
        if k <= 0 or not best.chain:
            return Draft([])
        self.drafted_from[where] += 1
        return Draft(best.chain[:k])

    def propose_tree(self, context: Sequence[int], k: int, width: int, nodes: int,
                     source: str | None = None) -> Draft:
        """propose()'s chain (up to k tokens) first, then the most probable other nodes of the same index's
        continuations of the match, merged into a tree (at most `width` children per node, `nodes` tokens)."""
        best, where = self._best(context)
        if k <= 0 or not best.chain:
            return Draft([])
        args = (k, self.max_depth, self.spec_factor, self.min_prob, nodes)
        index = self.store if where == "store" and self.store is not None else self._own
        tree = index.continuation(context, *args)
        self.drafted_from[where] += 1
        return tree_draft([best.chain[:k], *tree.branches], width, nodes)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn here: the context's index grows at the next proposal, the store when a request ends."""

    def outlook(self, context: Sequence[int]) -> tuple[str, int]:
        """A model-free proposal: no model to catch up."""
        return self.source, 0

    def shorter(self) -> tuple[str, SuffixDrafter] | None:
        """A hybrid's fallback for what this drafter leaves out: the same drafts without a score threshold
        (source SHORT_SUFFIX), None when there is none."""
        if self.min_score <= 0:
            return None
        return SHORT_SUFFIX, SuffixDrafter(self.store, 1, self.max_depth, self.spec_factor, self.min_prob)
