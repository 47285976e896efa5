"""`specdec train-drafter`: train a draft head for a target on this CPU within a time budget.

Loads the target (fp32, the head's reference: its embedding table, final norm and LM head), a cheaper
copy of it for producing features (the target specdec runs by default where its kernels run in SIMD --
the gguf target for a GGUF model, the int8 one on its lean runner for others: the features drafting will
read; else ``quantize_dynamic`` int8 where torch has a quantized CPU engine; else the fp32 model itself), gathers the
offline material (``specdec.training.data``) and trains
(``specdec.training.train``): the target answers the built-in prompts in batches while the head learns
from those answers and from the text; the user's own prompts (--prompts) are answered first.  The
agreement is measured on the target's answers to held-out prompts (a tenth of the user's where they gave
enough, else built-in ones), generated first.  Checkpoints go to ``$SPECDEC_HOME/drafters/<target>-head/`` (or --out) at
every evaluation, so an interrupted run keeps its last one; the time budget covers the whole command
after loading.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdec.errors import SpecdecError
from specdec.native.modelconfig import model_eos_token_ids
from specdec.runtime import loading, runners
from specdec.text import chat_ids

DRAFT_VOCAB = 16384  # a new head's draft vocabulary: the N most frequent tokens (train-drafter --draft-vocab)
HELDOUT_PROMPTS = 8  # prompts whose answers measure the agreement (never trained on)
MAX_PROMPT_TOKENS = 768


def load_target(spec: str) -> tuple[Any, Any]:
    """The fp32 transformers model and tokenizer of a target spec (zoo name, directory, .gguf, hub id)."""
    kind, location = loading.resolve(spec)
    model, tokenizer = loading._load_float(kind, location, torch.float32, None)
    return model.eval(), tokenizer


def int8_extractor(model: Any, target: str | None = None, batch: int = 16) -> Any:
    """The cheapest copy of `model` that produces the features the target runs with: for a `target` spec
    that runs by default on specdec's kernels, its runner there (specdec.training.features.LeanExtractor, `batch`
    prompts a forward): the gguf target's for a GGUF model, the int8 lean runner's for others; else a
    dynamically quantized int8 copy of `model`; else `model` itself, where torch has no quantized CPU engine."""
    dtype = runners.fastest_dtype(target) if target is not None else None
    if target is not None and dtype == loading.GGUF:
        from specdec.training.features import LeanExtractor

        runner, _ = loading.load_gguf(target)
        return LeanExtractor(runner, batch)
    if target is not None and dtype == "int8":
        from specdec.native import lean
        from specdec.training.features import LeanExtractor

        kind, location = loading.resolve(target)
        int8, _ = loading._load_int8(kind, location, None)
        if lean.supports(int8):
            return LeanExtractor(lean.LeanRunner(int8), batch)
    if not {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines):
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """A user turn through the chat template (plain "User: ... Assistant:" without one), capped in length."""
    return encode_messages(tokenizer, [("user", prompt)])


def encode_messages(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """(role, content) turns, a user turn last, through the chat template with the assistant's turn opened
    (plain "User: ...\n\nAssistant: ..." turns without one); its last MAX_PROMPT_TOKENS tokens."""
    if getattr(tokenizer, "chat_template", None):
        ids = chat_ids(tokenizer, messages)
    else:
        plain = "".join(f"{role.capitalize()}: {text}\n\n" for role, text in messages)
        ids = tokenizer(plain + "Assistant:")["input_ids"]
    return list(ids)[-MAX_PROMPT_TOKENS:]


def follow_up(tokenizer: Any, material: Any, index: int, answer: Sequence[int]) -> list[int] | None:
    """The prompt ids that follow the target's `answer` (ids) to material.prompts[index]: its
    data.FollowUp through the chat template; None where it has none or the answer is empty."""
    then = material.follow_ups.get(index)
    text = tokenizer.decode(list(answer), skip_special_tokens=True).strip() if then else ""
    return encode_messages(tokenizer, then.messages(material.prompts[index], text)) if text else None


class Split(NamedTuple):
    """Which prompts measure the agreement and which are trained on (token ids each)."""

    heldout: list[list[int]]
    train: list[list[int]]  # the user's own first, then the built-in ones
    builtin_from: int  # train[i] for i >= builtin_from is material.prompts[i - builtin_from + builtin_held]
    builtin_held: int  # built-in prompts held out (the first ones)
    described: str


def split_heldout(mine: list[list[int]], builtin: list[list[int]]) -> Split:
    """Split the user's own prompts `mine` and the built-in ones.  The agreement is measured on what the user
    asks where they gave enough prompts: a tenth of theirs, at most HELDOUT_PROMPTS (at least one when the
    built-in prompts cannot stand in); else on the first HELDOUT_PROMPTS built-in prompts."""
    spare = len(builtin) > HELDOUT_PROMPTS
    count = min(HELDOUT_PROMPTS, len(mine) // 10 if spare else max(len(mine) // 10, int(len(mine) > 1)))
    if count:
        return Split(mine[:count], mine[count:] + builtin, len(mine) - count, 0, f"{count} of your prompts")
    held = HELDOUT_PROMPTS if spare else 0
    return Split(builtin[:held], mine + builtin[held:], len(mine), held,
                 f"{held} built-in prompts" if held else "none: the training text's tail")


class Bar:
    """One status line on stderr, rewritten in place: time, tokens/s, loss, agreement by position, data."""

    def __init__(self, minutes: float) -> None:
        self.minutes, self.last = minutes, 0.0

    def __call__(self, p: Any) -> None:
        now = time.monotonic()
        if now - self.last < 0.5:
            return
        self.last = now
        agree = "/".join("-" if a is None else f"{a:.2f}" for a in p.agreement)
        sys.stderr.write(f"\r{p.seconds / 60:5.1f}/{self.minutes:g} min  step {p.step}  {p.tokens_per_s:,.0f} tok/s  "
                         f"loss {p.loss:.3f}  agreement {agree}  features {p.produced:,}  ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def say(began: float, what: str) -> None:
    """A phase line on stderr with the time since the run began."""
    sys.stderr.write(f"[{(time.monotonic() - began) / 60:4.1f} min] {what}\n")
    sys.stderr.flush()


def train_drafter(target: str, minutes: float = 60.0, texts: tuple[str, ...] = (), out: str | None = None,
                  builtin: bool = True, draft_vocab: int | None = None, seed: int = 0, int8: bool = True,
                  answer_tokens: int = 128, batch: int = 16, prompt_files: tuple[str, ...] = (),
                  fuse_layers: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Train and save a head for `target` (see the module docstring); returns the saved manifest.
    `draft_vocab` (default DRAFT_VOCAB) and `fuse_layers` (default none) shape a new head.  `resume`: go on
    training the head saved in `out` (or the default directory) for this target instead, from the material
    its runs did not reach (the same material options give the same material), its shape kept."""
    from specdec.head import manifest, store
    from specdec.training import data
    from specdec.training.features import LeanExtractor
    from specdec.training.train import TrainConfig, train

    began = time.monotonic()
    check_files(texts, prompt_files)
    # gathered before loading: a bad --prompts file is refused before the minutes of loading
    material = data.gather(seed=seed, extra=texts, builtin=builtin, prompt_files=prompt_files)
    directory = Path(out) if out else manifest.default_directory(target)
    if resume and not (directory / store.MANIFEST).is_file():
        raise SpecdecError(f"--resume: no draft head in {directory} to go on training (train one first, "
                           "or give its directory with --out)")
    model, tokenizer = load_target(target)
    head, before = store.load(directory, model, target) if resume else (None, None)
    taps = head_taps(model, head, fuse_layers, draft_vocab)
    extractor = int8_extractor(model, target, batch) if int8 else model
    kind = ((f"{extractor.runners[0].describe()}, lean runner" if isinstance(extractor, LeanExtractor) else "int8")
            if extractor is not model else "fp32")
    say(began, f"loaded {target} ({kind} features)")
    streams, split, generation = training_material(model, tokenizer, extractor, material, answer_tokens, batch, taps)
    say(began, "material: " + "; ".join(material.describe()))
    # the target's answers to held-out prompts measure the agreement; with only the user's text, its tail
    heldout = [chunk.ids for chunk in generation.answer(split.heldout)] if split.heldout else None
    starts = [len(p) for p in split.heldout] if heldout else None  # drafts count in the answers
    say(began, f"held-out answers: {len(heldout or [])} ({split.described})")
    identity = store.target_identity(model, target)
    if head is not None:
        assert before is not None  # the head's manifest, loaded with it
        say(began, f"going on from {directory}: {before.get('tokens_seen', 0):,} training tokens in "
                   f"{before.get('steps', 0):,} steps so far")
    config = TrainConfig(draft_vocab=draft_vocab or DRAFT_VOCAB, seed=seed, eval_every_s=120.0, eval_tokens=1024, eval_stride=8,
                         taps=taps,
                         minutes=max(minutes - (time.monotonic() - began) / 60, 0.1))
    bar = Bar(minutes)
    sources = [generation] if generation.prompts else []
    try:
        train(model, streams, config, heldout=heldout, progress=bar,
                       checkpoint=store.checkpointer(directory, identity, material.describe(), before),
                       sources=sources, shares=[1.0] + [2.0] * len(sources) if streams else None,
                       extractor=extractor, heldout_starts=starts, head=head,
                       cursor=before.get("cursor", []) if before else ())
    finally:
        bar.close()
    return store.read_manifest(directory) | {"directory": str(directory)}


def check_files(texts: Sequence[str], prompt_files: Sequence[str]) -> None:
    """--text and --prompts: each path there, a --prompts path not a directory."""
    for option, paths in (("--text", texts), ("--prompts", prompt_files)):
        for path in paths:
            if not Path(path).exists():
                raise SpecdecError(f"{option} {path}: no such file or directory")
    for path in prompt_files:
        if Path(path).is_dir():
            raise SpecdecError(f"--prompts {path}: a directory; give the prompt files")


def head_taps(model: Any, head: Any, fuse_layers: str | None, draft_vocab: int | None) -> tuple[int, ...]:
    """The layers the head reads: --fuse-layers for a new head; a head to go on training keeps its own,
    and a --draft-vocab or --fuse-layers that differs from its shape is refused."""
    from specdec.training.features import parse_taps

    try:
        taps = parse_taps("none" if fuse_layers is None else fuse_layers, int(model.config.num_hidden_layers))
    except ValueError as e:
        raise SpecdecError(str(e)) from None
    if head is not None:
        for option, differs, saved in (
                ("--draft-vocab", draft_vocab not in (None, len(head.vocab)), len(head.vocab)),
                ("--fuse-layers", fuse_layers is not None and taps != head.taps, ",".join(map(str, head.taps)) or "none")):
            if differs:
                raise SpecdecError(f"--resume keeps the saved head's shape: its {option} is {saved}; drop {option}")
        taps = head.taps
    return taps


def training_material(model: Any, tokenizer: Any, extractor: Any, material: Any, answer_tokens: int, batch: int,
                      taps: tuple[int, ...]) -> tuple[list[list[int]], Split, Any]:
    """(the texts' token streams, the prompts split into held-out and trained-on, the GenerationSource
    that answers the trained-on prompts with the target, follow-ups included); a SpecdecError without any."""
    from specdec.training.features import GenerationSource

    streams = [tokenizer(t)["input_ids"] for t in material.texts]
    builtin_prompts = [encode_prompt(tokenizer, p) for p in material.prompts]
    mine = [encode_messages(tokenizer, chat) for chat in material.chats]
    if not streams and not builtin_prompts and not mine:
        raise SpecdecError("no training material: give --text or --prompts files or keep the built-in data")
    split = split_heldout(mine, builtin_prompts)

    def then(i: int, answer: list[int]) -> list[int] | None:  # what follows the target's answer to split.train[i]
        if i < split.builtin_from:
            return None  # the user's own prompts have no follow-ups
        return follow_up(tokenizer, material, i - split.builtin_from + split.builtin_held, answer)

    eos = sorted(model_eos_token_ids(model) | ({tokenizer.eos_token_id} - {None}))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return streams, split, GenerationSource(extractor, split.train, eos, pad, answer_tokens, batch, then, taps)
