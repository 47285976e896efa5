"""Tokenizers: loading a saved one fast, and when a draft's token ids may be used as the target's.

Two tokenizers are the same when they map the same strings to the same ids.
The models' embedding matrices may still differ in width (padding rows, e.g.
151936 vs 152064): that is handled by cutting/padding logits, not here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.zoo import home, write_atomically

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What a saved tokenizer is made of (config.json too: transformers may pick the tokenizer's class from it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "config.json")
CACHE_FORMAT = 2


def installed_version(package: str) -> str:
    """The installed version of `package`, read from its dist-info folder's name beside it (no import of the
    package: transformers' takes half a second), else from importlib.metadata; "" when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ""
    site = Path(next(iter(spec.submodule_search_locations))).parent
    found = sorted(site.glob(f"{package}-*.dist-info"))
    if len(found) == 1:
        return found[0].name[len(package) + 1: -len(".dist-info")]
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def tokenizer_key(folder: str | Path) -> str | None:
    """A digest of the tokenizer saved in `folder` (where it is, its files' sizes and modification times, as the
    packed-weights cache keys a model file: hashing their 10 MB took 30 ms at every start) and of the transformers
    and tokenizers versions that build it; None for a folder with no tokenizer.json (nothing to gain from a cache)."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    # the folder too: a tokenizer remembers where it was loaded from (name_or_path)
    digest = hashlib.sha256(repr((CACHE_FORMAT, installed_version("transformers"), installed_version("tokenizers"),
                                  str(folder.resolve()))).encode())
    for name in TOKENIZER_FILES:
        try:
            stat = (folder / name).stat()
        except OSError:
            continue
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:24]


def saved_tokenizer(location: str | Path, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(location), through a pickle kept in `cache_dir` (default
    $SPECDEC_HOME/tokenizers/pickled) per tokenizer_key: transformers takes a second to build the zoo's Qwen
    tokenizer (it parses tokenizer.json in Python), unpickling the built one a third of that (Zen 4).  A hub id,
    a folder without tokenizer.json or an unwritable cache load as before; a cached pickle that cannot be read
    is rebuilt, with one line on stderr saying so."""
    from transformers import AutoTokenizer

    folder = Path(location)
    key = tokenizer_key(folder) if folder.is_dir() else None
    if key is None:
        return AutoTokenizer.from_pretrained(location)
    if cache_dir is None:
        cache_dir = home() / "tokenizers" / "pickled"
    path = cache_dir / f"{key}.pkl"
    if path.is_file():
        try:
            return pickle.loads(path.read_bytes())
        except Exception as e:  # noqa: BLE001 -- truncated, corrupt, or from a library that changed under it
            print(f"specdec: the cached tokenizer {path} could not be read ({type(e).__name__}); rebuilding it",
                  file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(location)
    try:
        write_atomically(path, pickle.dumps(tokenizer))
    except (pickle.PicklingError, TypeError, AttributeError):
        pass  # a tokenizer that does not pickle: built again next time
    return tokenizer


def fast_tokenizer(location: str | Path) -> Any:
    """saved_tokenizer(location) as a specdec.tokenizer.LeanTokenizer where a snapshot of it stands for it (no
    transformers import at all: the zoo's tokenizers all have one), else that transformers tokenizer.  The
    snapshots live beside the pickles, in $SPECDEC_HOME/tokenizers/lean."""
    folder = Path(location)
    key = tokenizer_key(folder) if folder.is_dir() else None
    if key is None:
        return saved_tokenizer(location)
    from specdec.tokenizer import lean_tokenizer

    return lean_tokenizer(key, home() / "tokenizers" / "lean", lambda: saved_tokenizer(location))


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when both tokenizers have identical token -> id maps (added tokens included)."""
    if a is b or getattr(a, "backend_tokenizer", a) is getattr(b, "backend_tokenizer", b):
        return True  # one object, or two lean tokenizers over one parsed vocabulary
    return a.get_vocab() == b.get_vocab()


def decoded(text: str | list[str]) -> str:
    """What tokenizer.decode returned for one sequence of ids: its text (transformers types the result of a
    batch, a list, alike)."""
    assert isinstance(text, str), "decode was given one sequence of ids"
    return text
