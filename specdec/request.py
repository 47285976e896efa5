"""One request's options: :class:`RequestConfig`, validated once, whoever asks.

The CLI (``specdec generate``, and ``specdec serve`` for its per-request defaults), the server (OpenAI's
fields and the ``"speculative"`` extension object) and the Python API (``Engine.stream``,
``specdec.generate``) all build a RequestConfig, and ``Engine.stream(prompt, config)`` is the one place
a request is set up from it.  Each field carries an :class:`Option` in its metadata: its CLI flags and
help, and whether a server request may set it; the CLI's options and the server's extension are made
from these, so a new option is one new field here.

A value the config refuses raises a :class:`RequestError` naming the field, so that each caller can
name the option in its own words (``--num-speculative-tokens``, ``speculative.k``, "the number of
speculative tokens").
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from specdec.algorithm.control import AUTO, Controller, parse_speculation
from specdec.algorithm.draft import TreeShape, parse_tree
from specdec.algorithm.params import SamplingParams
from specdec.constrain.spec import Constraint
from specdec.errors import SpecdecError

MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit; specdec.algorithm.logprobs)

# How the draft model drafts: "same" (shared tokenizer: ids are used as they are), "text" (another
# tokenizer: proposals cross over as text, verified without q), "intersection" (another tokenizer: the
# draft is restricted to the shared tokens and its q is used).  "auto" = "same" when the vocabularies are
# identical, else "text".
DRAFT_MODES = ("auto", "same", "text", "intersection")
VERIFY_MODES = ("causal", "block", "stairs")  # how a draft is checked (specdec.algorithm.block, specdec.algorithm.stairs)
MAX_SERVED_K = 32  # the most draft tokens a server request may ask for per step (a forward's size stays bounded)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")
# The roles of a chat message that specdec reads (OpenAI's; "developer" is its newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant")


def message_text(content: Any) -> str | None:
    """A chat message's content as text, as OpenAI's API takes it: a string, a list of text parts
    ({"type": "text", "text": ...} each; joined), or null (""); None for anything else.  The server's
    requests and ``train-drafter --prompts`` files read messages alike."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    return None


class RequestError(SpecdecError):
    """A request option the config refuses.  `field` names it; `reason` says what is wrong, after the
    option's name where `labelled` (e.g. "must be > 0, got 0"), or whole."""

    def __init__(self, field: str, reason: str, label: str | None = None) -> None:
        super().__init__(f"{label} {reason}" if label else reason)
        self.field, self.reason, self.labelled = field, reason, label is not None

    def named(self, name: str) -> str:
        """The message with the option called `name` (a CLI flag, a JSON path)."""
        return f"{name} {self.reason}" if self.labelled else self.reason


@dataclass(frozen=True)
class Option:
    """How a RequestConfig (or EngineConfig: specdec.engine_config) field reaches its callers.

    flags: the CLI's option names (none: not a CLI option); help: the CLI's help text;
    cli_type: the type the CLI parses, where not the field's own; choices: the values a str takes;
    minimum: the least number the CLI takes.
    per_request: a server request may set it in its "speculative" object, as `wire` (default the
    field's name), a JSON value of `json_type`; server_max: the most a request may ask for there;
    serve's defaults for it are CLI options of `specdec serve` too.
    label: the field's name in the Python API's messages; aliases: older keyword names.
    """

    flags: tuple[str, ...] = ()
    help: str = ""
    cli_type: Any = None
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    per_request: bool = False
    wire: str | None = None
    json_type: Any = None
    server_max: int | None = None
    label: str | None = None
    aliases: tuple[str, ...] = ()


def option(default: Any, *flags: str, **how: Any) -> Any:
    """A config field with its Option (see Option for `how`)."""
    return field(default=default, metadata={"option": Option(flags=flags, **how)})


@dataclass(frozen=True)
class RequestConfig:
    """Every per-request option, validated when made (a RequestError or SamplingParams' SpecdecError)."""

    max_new_tokens: int = option(128, "--max-new-tokens", "-n", help="Most tokens to generate.",
                                 label="max_new_tokens")
    k: int | str | Controller = option(
        AUTO, "--num-speculative-tokens", "-k", cli_type=str, per_request=True, json_type=int | str,
        server_max=MAX_SERVED_K, label="the number of speculative tokens", aliases=("num_speculative_tokens",),
        help="Draft tokens per step: 'auto' (a cost model picks 0..24 each step from measured speeds and "
             "acceptance; 0 = a plain step) or a fixed γ.")
    speculative: bool = option(True, per_request=True, wire="enabled", json_type=bool, aliases=("use_draft",))
    draft_mode: str = option(
        "auto", "--draft-mode", choices=DRAFT_MODES, per_request=True, json_type=str,
        help="same: shared tokenizer; text / intersection: another tokenizer (via text / shared tokens); "
             "auto picks.")
    draft_confidence: float | None = option(
        None, "--draft-confidence", per_request=True, json_type=float | None, label="the draft confidence",
        help="Stop drafting after a token the draft model gave less than this probability (0..1; off by "
             "default). Never changes the output.")
    verify: str = option(
        "causal", "--verify", choices=VERIFY_MODES, per_request=True, json_type=str,
        help="causal: the draft checked by one target forward over its tokens, token by token; block: the same "
             "forward, a sampled draft verified as a block (Sun et al. 2024: as many tokens accepted or more, the "
             "same distribution; greedy: as causal); stairs: the target asked only for next-token predictions "
             "on a staircase of prefixes (greedy only; same output).")
    tree: str = option(
        "off", "--tree", per_request=True, json_type=str,
        help="Draft token trees verified in one target forward: off (chains), auto (width 2, depth by -k), "
             "or <width>x<depth> such as 2x4. Same output; more tokens per forward where extra rows are cheap.")
    stop: tuple[str, ...] = option((), "--stop", cli_type=list[str] | None,
                                   help="Stop string (repeatable); not included in the text.")
    chat: bool = option(False, "--chat", help="Apply the target's chat template to the prompt.")
    temperature: float = option(0.0, "--temperature", help="0 = greedy.")
    top_k: int = option(0, "--top-k", help="0 = off.")
    top_p: float = option(1.0, "--top-p", help="1.0 = off.")
    seed: int | None = option(None, "--seed", help="Seed for sampling.")
    presence_penalty: float = option(
        0.0, "--presence-penalty", label="presence_penalty",
        help="Subtracted from the logit of each token already generated (-2..2; OpenAI's). Speculation stays "
             "lossless: the penalised distribution is the one verified.")
    frequency_penalty: float = option(
        0.0, "--frequency-penalty", label="frequency_penalty",
        help="Subtracted from a token's logit once per time it was generated (-2..2; OpenAI's).")
    repetition_penalty: float = option(
        1.0, "--repetition-penalty", label="repetition_penalty",
        help="Divides the positive logits (multiplies the negative ones) of the tokens in the prompt and the "
             "output (> 0, 1 = off; transformers' and vLLM's).")
    logit_bias: tuple[tuple[int, float], ...] = option(
        (), "--logit-bias", cli_type=list[str] | None, label="logit_bias",
        help="TOKEN_ID:BIAS added to that token's logit (repeatable; -100..100: -100 bans, 100 forces).")
    # a LogitsProcessor object of the caller's (specdec.algorithm.processors: a grammar's mask, ...), applied after
    # logit_bias and the penalties; the Python API's only (no flag, no request field)
    logits_processor: Any = option(None, label="logits_processor")
    # what the output must be (specdec.constrain.Constraint: a JSON schema, any JSON object, a regex, a Lark or GBNF
    # grammar); the target's distribution is masked by it at every position, speculation on.  generate's
    # --json-schema / --grammar / --regex, the server's response_format, the Python API's constraint=
    constraint: Constraint | None = option(None, label="constraint")
    logprobs: int | None = option(
        None, "--logprobs", label="logprobs",
        help="Report each generated token's log-probability under the target (its raw distribution) and its "
             "N most likely alternatives (0..20; in --json's output, \"logprobs\").")

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise RequestError("max_new_tokens", f"must be > 0, got {self.max_new_tokens}", "max_new_tokens")
        if not isinstance(self.k, Controller):
            try:
                object.__setattr__(self, "k", parse_speculation(self.k))
            except SpecdecError as e:
                raise RequestError("k", str(e), "the number of speculative tokens") from None
        check_draft_mode(self.draft_mode)
        if self.draft_confidence is not None and not 0 < self.draft_confidence < 1:
            raise RequestError("draft_confidence", f"must be between 0 and 1, got {self.draft_confidence}",
                               "the draft confidence")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)
        object.__setattr__(self, "_sampling", sampling)
        check_verify_mode(self.verify, sampling.greedy)
        try:
            shape = parse_tree(self.tree)
        except SpecdecError as e:
            raise RequestError("tree", str(e)) from None
        if shape is not None and self.verify == "stairs":
            raise RequestError("tree", f"token trees need causal verification, not {self.verify}")
        object.__setattr__(self, "_tree", shape)
        self._check_processing()

    def _check_processing(self) -> None:
        """The penalties', logit_bias' and logprobs' values checked (logit_bias normalised to sorted pairs)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise RequestError(name, f"must be a number in -2..2, got {value}", name)
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 10.0):
            raise RequestError("repetition_penalty", f"must be a number in (0, 10], got {self.repetition_penalty}",
                               "repetition_penalty")
        object.__setattr__(self, "logit_bias", parse_logit_bias(self.logit_bias))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise RequestError("constraint", f"must be a specdec.constrain.Constraint, got {type(self.constraint).__name__}",
                               "constraint")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError("logprobs", f"must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}",
                               "logprobs")

    def processor(self, grammar: Any = None) -> Any:
        """The request's logits processor (specdec.algorithm.processors: logit_bias, then the penalties, then the
        caller's logits_processor, then `grammar`'s mask: the constraint compiled, specdec.constrain.Grammar), or
        None where it changes nothing.  Imports torch; a new one per generation (a grammar's walks its own)."""
        from specdec.algorithm.processors import LogitBias, Penalties, chain

        penalties = Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        masked = None
        if grammar is not None:
            from specdec.constrain.processor import GrammarProcessor

            masked = GrammarProcessor(grammar)
        return chain(LogitBias(dict(self.logit_bias)) if self.logit_bias else None,
                     penalties if penalties.active else None, self.logits_processor, masked)

    @property
    def tree_shape(self) -> TreeShape | None:
        """The tree option parsed (specdec.algorithm.draft.parse_tree): None for chains."""
        return self._tree  # type: ignore[attr-defined]  # set (and validated) in __post_init__

    @property
    def sampling(self) -> SamplingParams:
        return self._sampling  # type: ignore[attr-defined]  # set (and validated) in __post_init__

    @classmethod
    def from_options(cls, config: RequestConfig | None = None, /, **options: Any) -> RequestConfig:
        """`config` (default: every default) with keyword options changed: the fields' names, their older
        aliases (num_speculative_tokens, use_draft), or sampling=SamplingParams(...) for the four sampling
        fields.  An unknown keyword is a TypeError, as a function's would be."""
        sampling = options.pop("sampling", None)
        if sampling is not None:
            if any(name in options for name in SAMPLING_FIELDS):
                raise TypeError("give sampling= or temperature / top_k / top_p / seed, not both")
            options.update({name: getattr(sampling, name) for name in SAMPLING_FIELDS})
        names = field_names()
        changes = {}
        for name, value in options.items():
            if names.get(name) is None:
                raise TypeError(f"unexpected request option '{name}'")
            changes[names[name]] = value
        base = config if config is not None else cls()
        return dataclasses.replace(base, **changes) if changes else base


def parse_logit_bias(given: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as a config holds it: (token id, bias) pairs in id order, from a mapping {id: bias} (ids as ints
    or decimal strings: JSON's keys), pairs, "ID:BIAS" strings (the CLI's) or None (none); a RequestError for anything else,
    a negative id or a bias outside -100..100.  The ids' upper bound is the vocabulary's: the engine's to check."""
    items: list[Any]
    if given is None:  # (the CLI's, for no --logit-bias)
        return ()
    if isinstance(given, dict):
        items = list(given.items())
    elif isinstance(given, (list, tuple)):
        items = [tuple(item.split(":", 1)) if isinstance(item, str) else item for item in given]
    else:
        raise RequestError("logit_bias", f"must map token ids to biases, got {type(given).__name__}", "logit_bias")
    pairs: dict[int, float] = {}
    for item in items:
        try:
            token, bias = item
            ok_token = isinstance(token, int) and not isinstance(token, bool) or isinstance(token, str)
            token_id = int(token) if ok_token else None
            value = float(bias) if not isinstance(bias, bool) else None
        except (TypeError, ValueError):
            token_id = value = None
        if token_id is None or value is None or token_id < 0:
            raise RequestError("logit_bias", f"must map token ids (integers >= 0) to numbers, got {item!r}",
                               "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError("logit_bias", f"biases must be in -100..100, got {value} for token {token_id}",
                               "logit_bias")
        pairs[token_id] = value
    return tuple(sorted(pairs.items()))


def check_draft_mode(mode: str) -> str:
    """`mode` if it is a draft mode, else a RequestError."""
    if mode not in DRAFT_MODES:
        raise RequestError("draft_mode", f"unknown draft mode '{mode}': expected one of {', '.join(DRAFT_MODES)}")
    return mode


def check_verify_mode(mode: str, greedy: bool = True) -> str:
    """The verification mode, or a RequestError for an unknown one, or for stairs with sampling
    (greedy=False): stairs is greedy only."""
    if mode not in VERIFY_MODES:
        raise RequestError("verify", f"unknown verification '{mode}': expected one of {', '.join(VERIFY_MODES)}")
    if mode == "stairs" and not greedy:
        raise RequestError("verify", "stairs verification is greedy only: drop --temperature, or use --verify causal")
    return mode


def options() -> list[tuple[dataclasses.Field, Option]]:
    """RequestConfig's fields with their Options, in order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(RequestConfig)]


def field_type(f: dataclasses.Field, owner: type = RequestConfig) -> Any:
    """A field's type (its annotation in `owner`, resolved)."""
    return _type_hints(owner)[f.name]


@functools.cache
def _type_hints(owner: type) -> dict[str, Any]:
    """`owner`'s resolved annotations, once per class: resolving them anew for each of the CLI's 61 options took
    14 ms of every command's start."""
    return typing.get_type_hints(owner)


def field_names() -> dict[str, str]:
    """Keyword -> field name, for the fields' names and their aliases."""
    names = {f.name: f.name for f, _ in options()}
    names.update({alias: f.name for f, o in options() for alias in o.aliases})
    return names


def cli_fields(per_request: bool = False) -> list[tuple[dataclasses.Field, Option]]:
    """The fields the CLI takes as options (with per_request: those a server request may set too)."""
    return [(f, o) for f, o in options() if o.flags and (o.per_request or not per_request)]


def served_fields() -> dict[str, tuple[dataclasses.Field, Option]]:
    """The fields a server request may set, by their name in its "speculative" object."""
    return {o.wire or f.name: (f, o) for f, o in options() if o.per_request}
