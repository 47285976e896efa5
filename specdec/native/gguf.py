"""The gguf target: a GGUF file's own quantised blocks on specdec's kernels, every layer in one C call.

``--dtype gguf`` runs a llama / mistral / qwen2 / qwen3 / phi3 / gemma2 / gemma3 GGUF model as the file stores
it: its blocks of any type :mod:`specdec.native.kernels.gguf` takes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; F32 / F16 / BF16 matrices in a fixed-order float product) -- the integers and
scales the user downloaded, not an int8 requantisation of a de-quantised copy -- multiplied by specdec's block
kernel (8-bit block activations, exact integer sums, one fixed sequence of fp32 operations per block), with the norms,
rotary embeddings, attention (specdec's exact kernel), the gated MLP and the residual adds of every layer in one C
call (:mod:`specdec.native.kernels.layers`).  A decode step reads each weight block once: about 4.5-6.5 bits a
weight for a Q4_K_M file against int8's 8, which is what a memory-bound one-token step costs.

**Architectures** (:data:`ARCHS`, one :class:`Architecture` each: the table is the one place where they differ).
An architecture names every tensor its files may hold and every metadata key under its name that it reads or
knows changes nothing; :func:`account` refuses, in one line naming it, a file with any other tensor or key (a
``rope_freqs.weight`` where the architecture has none, a bias, an extra norm, rotary scaling other than linear,
soft-capping, a partial rotary embedding, experts, ...) or with norms and linears of other shapes than its
config's: the gguf target never runs a file as a silently different model.  The layers it computes are
kernels/layers.c's: llama's (pre-norm, grouped-query rotary attention, a SiLU-gated MLP), with qwen2's q / k / v
biases, mistral's sliding window, qwen3's per-head q / k norms, phi3's fused q / k / v and gate / up tensors (as
they are: their rows are the linears' side by side; no sliding window, as llama.cpp's phi3), Gemma 3's q / k
norms, norms on the attention's and the MLP's outputs (the file stores Gemma's norms as 1 + w, the factor they
scale by), a tanh-GELU gate (llama.cpp's, of fp16 values: FILE_ACTIVATIONS), an embedding scaled by sqrt(hidden),
sliding-window layers rotating with their own base (Gemma 2's: one base, a window on every other layer, its
attention scores and logits soft-capped, c * tanh(x / c)), and Llama 3's rotary scaling (the per-frequency
divisors of ``rope_freqs.weight``), with the rotary tables llama.cpp computes (:class:`FileRotary`).  Each is
checked against transformers' model of the file with the kernel's block activations and against llama.cpp's
logits of the same file (tests/native/test_gguf_arch*.py).

**Exact speculation.**  Every operation computes a token's numbers from its own row in a fixed order, so a
token's logits are bitwise the same alone, in a k-token verification and in a prefill (batch invariance, as
the int8 target has; tested on random forward/rollback sequences): speculative output is exactly the gguf
target's plain output, greedy and sampled.  Its numbers are its own model's -- the file's weights with
8-bit block activations, as llama.cpp multiplies them -- not llama.cpp's bits nor the fp32 model's
(`specdec quality` measures the distance to the fp32 de-quantised file).

**Unlike llama.cpp**, whose small-batch kernels re-read and re-unpack each block for every row of a
verification (t(8) ~ 6 t(1) on a 2-core Zen 4), the block kernel unpacks a block once for up to 8 rows, so
verifying a draft costs little more than a step: the regime speculative decoding needs.

The runner is a :class:`specdec.native.lean.LeanRunner` (its KV cache, rollback, token trees, hidden
states, packed forwards of several sequences) whose layer set is :class:`GGUFLayers`.  The GGUF file is read
here (its header and tensor table; the blocks memory-mapped), its config mapped to the transformers config
values of the architecture and read as transformers would read them without importing it
(:mod:`specdec.native.modelconfig`); llama-architecture files store their q and k rows permuted for llama.cpp's rotary
layout, which packing undoes (a permutation of output channels: the same integers).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from specdec.backends.tree import Tree
from specdec.errors import SpecdecError
from specdec.native import kernels
from specdec.native.kernels.bindings import LayersModel
from specdec.native.kernels.gguf import BLOCK, FILE_BYTES, NAMES, Part, Parts
from specdec.native.lean import (
    ACTIVATIONS,
    LayerSet,
    LeanRunner,
    Rotary,
    RotaryTables,
    TrimmedHead,
    _Layer,
    _NativeTable,
    _rope_kinds,
)
from specdec.native.modelconfig import ModelConfig, attention_shape, eos_id_set, model_config
from specdec.native.packcache import cache_for, file_identity
from specdec.zoo import home, write_atomically

F32, F16 = 0, 1  # ggml type ids of unquantised tensors (norms, biases)
Q4_1 = 3  # the type a draft's weights are requantised to (GGUFModel's requantize)
REQUANTIZE_ROWS = 4096  # rows de-quantised at a time when requantising (a 151,936-row head: 4096 x 4 x 896 bytes)

# ---------------------------------------------------------------- the file: header, metadata, tensor table

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
INDEX_FORMAT = 2  # of the parsed header kept per file (GGUFFile._read_index)
_KEEP_ARRAY = 1024  # arrays up to this many elements are read (per-layer values); longer ones (a vocabulary) skipped


@dataclass(frozen=True)
class Tensor:
    """A tensor of the file: ggml's type id, its shape as ggml lists it ([columns, rows]), its data's offset."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int  # from the start of the file (of its part: `shard`)
    shard: int = 0  # which part of a split model holds it (GGUFFile.paths; 0 for a file in one piece)

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1

    @property
    def columns(self) -> int:
        return self.shape[0]

    def nbytes(self) -> int:
        if self.type_id == F32:
            return 4 * self.rows * self.columns
        if self.type_id == F16:
            return 2 * self.rows * self.columns
        if self.type_id not in BLOCK:
            return -1
        return self.rows * self.columns // BLOCK[self.type_id] * FILE_BYTES[self.type_id]


class GGUFFile:
    """A GGUF file's metadata (scalars and short arrays; long arrays, a vocabulary's, skipped) and tensor table,
    its bytes memory-mapped (read-only: pages the OS shares between processes and drops under pressure), and
    what identifies its vocabulary (`vocabulary`: vocabulary_digest of its tokenizer.ggml.tokens, None without).

    A model split by llama.cpp's gguf-split (<stem>-00001-of-0000N.gguf ...: each part a GGUF file of its own
    header and tensor table, the model's metadata in the first, split.no / split.count / split.tensors.count in
    each) is read from its first part: `paths` lists the parts, each tensor is read from its own part's mapping.
    Any other part, or a set with a part missing, is a one-line SpecdecError naming the part."""

    TOKENS_KEY = "tokenizer.ggml.tokens"  # the vocabulary's token strings, by id
    # convert_hf_to_gguf's filler for the ids past a tokenizer's last token ("[PAD151935]"): not the vocabulary's
    _PAD_TOKEN = re.compile(rb"\[PAD\d+\]")
    SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"  # gguf-split's keys
    _SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # its parts' names

    class PartError(SpecdecError):
        """A split model's part given in place of its first, or a part missing: no other reader can load it either."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.paths = [self.path]  # the parts of a split model, the first (`path`) first; `path` alone otherwise
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        self.vocabulary: str | None = None
        try:
            self.shards = [np.memmap(self.path, dtype=np.uint8, mode="r")]  # each part's bytes, as `paths`
            if not self._read_index():
                self._parse()
                self._write_index()
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise SpecdecError(f"cannot read GGUF file {self.path}: {e}") from e
        self.data = self.shards[0]  # the (first) file's bytes

    # The parsed header is kept in $SPECDEC_HOME/gguf-index, per file (its real path, size and modification time;
    # a split model's every part's): walking past a vocabulary's 150,000 strings takes 90 ms of Python at every
    # start, reading the index 2.
    def _index_path(self) -> Path:
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:20]
        return home() / "gguf-index" / f"{digest}.json"

    def _read_index(self) -> bool:
        """The metadata and tensor table from this file's index, when it has a current one (False: parse)."""
        path = self._index_path()
        if not path.is_file():
            return False
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            if index["format"] != INDEX_FORMAT:
                return False  # another specdec's index (its fields are not these): parsed again
            files = index["files"]
            if files[0] != file_identity(self.path):
                return False  # another version of the file: parsed again
            try:
                if any(file_identity(part["path"]) != part for part in files[1:]):
                    return False  # another version of a later part
            except OSError:
                return False  # a part gone: parsing says which
            self.metadata, self.vocabulary = index["metadata"], index["vocabulary"]
            self.tensors = {name: Tensor(name, type_id, tuple(shape), offset, shard)
                            for name, type_id, shape, offset, shard in index["tensors"]}
            self.paths = [self.path, *(Path(part["path"]) for part in files[1:])]
            self.shards += [np.memmap(part, dtype=np.uint8, mode="r") for part in self.paths[1:]]
            return True
        except (ValueError, KeyError, TypeError, IndexError) as e:
            print(f"specdec: the GGUF index {path} could not be read ({type(e).__name__}); parsing the file again",
                  file=sys.stderr)
            self.metadata, self.tensors, self.vocabulary, self.paths = {}, {}, None, [self.path]
            del self.shards[1:]
            return False

    def _write_index(self) -> None:
        index = {"format": INDEX_FORMAT, "files": [file_identity(part) for part in self.paths],
                 "metadata": self.metadata, "vocabulary": self.vocabulary,
                 "tensors": [[t.name, t.type_id, list(t.shape), t.offset, t.shard] for t in self.tensors.values()]}
        write_atomically(self._index_path(), json.dumps(index))

    def _parse(self) -> None:
        """The header and tensor table of the file, and of a split model's later parts (each mapped: `shards`)."""
        self.metadata, self.tensors, self.vocabulary = self._parse_part(0)
        number, count = int(self.metadata.get(self.SPLIT_NO, 0)), int(self.metadata.get(self.SPLIT_COUNT, 1))
        if count <= 1:
            return
        self.paths = self._parts(number, count)
        for shard, part in enumerate(self.paths[1:], start=1):
            self.shards.append(np.memmap(part, dtype=np.uint8, mode="r"))
            metadata, tensors, _ = self._parse_part(shard)
            if int(metadata.get(self.SPLIT_NO, -1)) != shard:
                raise ValueError(f"{part.name} says it is part {int(metadata.get(self.SPLIT_NO, -1)) + 1}, not {shard + 1}")
            self.tensors.update(tensors)
        expected = self.metadata.get(self.SPLIT_TENSORS)
        if expected is not None and int(expected) != len(self.tensors):
            raise ValueError(f"its {count} parts hold {len(self.tensors)} tensors, the first says {expected}")

    def _parts(self, number: int, count: int) -> list[Path]:
        """The paths of a split model's parts, by gguf-split's names, from its part `number` (0-based) of `count`;
        a one-line SpecdecError for a later part than the first or a part missing."""
        named = self._SPLIT_NAME.match(self.path.name)
        if named is None:
            raise self.PartError(f"{self.path.name} is part {number + 1} of {count} of a split GGUF model, and its name "
                               "is not gguf-split's (<name>-00001-of-00003.gguf): its other parts cannot be found")
        parts = [self.path.with_name(f"{named['stem']}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]
        if number != 0:
            raise self.PartError(f"{self.path.name} is part {number + 1} of {count} of a split GGUF model: "
                               f"give its first part, {parts[0].name}")
        missing = [part.name for part in parts[1:] if not part.is_file()]
        if missing:
            raise self.PartError(f"split GGUF model {self.path.name}: part{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(missing)} of {count} missing from {self.path.parent}")
        return parts

    def _parse_part(self, shard: int) -> tuple[dict[str, Any], dict[str, Tensor], str | None]:
        """The metadata, tensors and vocabulary digest of part `shard`'s own header (self.shards[shard])."""
        data = self.shards[shard]
        metadata: dict[str, Any] = {}
        tensors: dict[str, Tensor] = {}
        vocabulary = None
        buf = memoryview(data)  # type: ignore[arg-type]  # numpy's stubs give memmap no __buffer__; it has one
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        at = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n

        def value(kind: int, at: int) -> tuple[Any, int]:
            if kind in _SCALARS:
                fmt = _SCALARS[kind]
                return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
            if kind == _STRING:
                return string(at)
            if kind == _ARRAY:
                inner, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if inner in _SCALARS:
                    size = struct.calcsize(_SCALARS[inner])
                    items = (np.frombuffer(buf, dtype=np.dtype(_SCALARS[inner]), count=count, offset=at).tolist()
                             if count <= _KEEP_ARRAY else None)
                    return items, at + size * count
                if inner == _STRING and count > _KEEP_ARRAY:  # skip: walk the lengths only
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, at)
                        at += 8 + n
                    return None, at
                items = []
                for _ in range(count):
                    item, at = value(inner, at)
                    items.append(item)
                return items, at
            raise ValueError(f"unknown metadata value type {kind}")

        for _ in range(n_kv):
            key, at = string(at)
            (kind,) = struct.unpack_from("<I", buf, at)
            metadata[key], end = value(kind, at + 4)
            if key == self.TOKENS_KEY and kind == _ARRAY:  # the strings' raw bytes: (length, UTF-8 bytes) each
                vocabulary = self._raw_digest(buf, at + 4 + 12, end)
            at = end
        infos = []
        for _ in range(n_tensors):
            name, at = string(at)
            (dims,) = struct.unpack_from("<I", buf, at)
            shape = struct.unpack_from(f"<{dims}Q", buf, at + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            infos.append((name, type_id, tuple(int(d) for d in shape), offset))
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-at // alignment) * alignment
        for name, type_id, shape, offset in infos:
            tensor = Tensor(name, int(type_id), shape, start + int(offset), shard)
            if tensor.nbytes() >= 0 and tensor.offset + tensor.nbytes() > len(data):
                raise ValueError(f"tensor {name} runs past the end of {self.paths[shard].name} (truncated?)")
            tensors[name] = tensor
        return metadata, tensors, vocabulary

    @classmethod
    def vocabulary_digest(cls, tokens: Sequence[str | bytes]) -> str:
        """What identifies a vocabulary: a digest of its token strings in id order, the trailing "[PAD<n>]"
        fillers dropped, each as a GGUF file stores it (its length, 8 bytes little-endian, then its UTF-8 bytes):
        a file's tokenizer.ggml.tokens gives the digest of its raw bytes (`vocabulary`), a transformers
        tokenizer's get_vocab() the same one for the same token -> id map (specdec.drafters.choice)."""
        raw = b"".join(struct.pack("<Q", len(t)) + t for t in (t.encode() if isinstance(t, str) else t for t in tokens))
        return cls._raw_digest(memoryview(raw), 0, len(raw))

    @classmethod
    def _raw_digest(cls, buf: memoryview, start: int, end: int) -> str:
        """vocabulary_digest of the packed strings in buf[start:end] (length-prefixed, as a GGUF array stores them)."""
        ends, at = [], start
        while at < end:
            (n,) = struct.unpack_from("<Q", buf, at)
            at += 8 + n
            ends.append(at)
        cut = len(ends)  # the trailing fillers dropped
        while cut and cls._PAD_TOKEN.fullmatch(bytes(buf[(ends[cut - 2] if cut > 1 else start) + 8 : ends[cut - 1]])):
            cut -= 1
        return hashlib.sha256(buf[start : ends[cut - 1] if cut else start]).hexdigest()[:16]

    def parameters(self) -> int:
        """The model's parameter count from its tensor table, as its model card counts it: an output head of the
        embedding's shape counted as the embedding (a tied head, which converters write out again: the zoo's
        Qwen 1.5B is 1.54B, not the 1.78B of its tensors)."""
        count = sum(int(np.prod(t.shape)) for t in self.tensors.values())
        head, embedding = self.tensors.get("output.weight"), self.tensors.get("token_embd.weight")
        if head is not None and embedding is not None and head.shape == embedding.shape:
            count -= int(np.prod(head.shape))
        return count

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata `key` under the architecture's prefix ("block_count" -> "qwen2.block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def blocks(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as stored (a view of the mapped file)."""
        tensor = self.tensors[name]
        return self.shards[tensor.shard][tensor.offset : tensor.offset + tensor.nbytes()]

    def release(self, names: Sequence[str]) -> None:
        """Let the OS drop this mapping's pages of tensors `names` (their packed copies are in memory now): they
        stay in the page cache, reclaimable, but leave the process's resident memory."""
        import mmap

        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        for name in names:
            tensor = self.tensors[name]
            raw = getattr(self.shards[tensor.shard], "_mmap", None)  # its part's memmap's mmap object
            if raw is None:
                return
            start = -(-tensor.offset // page) * page  # whole pages inside the tensor only
            end = (tensor.offset + tensor.nbytes()) // page * page
            if end > start:
                try:
                    raw.madvise(mmap.MADV_DONTNEED, start, end - start)
                except (OSError, ValueError):
                    return

    def weight_types(self) -> str:
        """The types of the file's weight matrices by their share of its weight bytes, and the output head's:
        "Q5_0 55%, Q8_0 30%, Q6_K 9%, Q4_K 6% of the weight bytes; output head Q8_0" (a tied head is the
        embedding: "output head Q5_0, the embedding's").  What a file name's "Q4_K_M" leaves out: a quantiser
        mixes types, and which one the head (a seventh of a small model) has moves a step's cost."""
        shares: dict[str, int] = {}
        for tensor in self.tensors.values():
            if len(tensor.shape) > 1:  # matrices: norms and biases are a vector each
                name = _type_name(tensor.type_id)
                shares[name] = shares.get(name, 0) + max(0, tensor.nbytes())
        total = sum(shares.values()) or 1
        ranked = sorted(shares.items(), key=lambda item: -item[1])
        line = ", ".join(f"{name} {size / total:.0%}" for name, size in ranked) + " of the weight bytes"
        head = self.tensors.get("output.weight")
        tied = head is None
        head = head or self.tensors.get("token_embd.weight")
        if head is None:
            return line
        return f"{line}; output head {_type_name(head.type_id)}" + (", the embedding's" if tied else "")

    def float_tensor(self, name: str) -> torch.Tensor:
        """An F32 or F16 tensor (a norm's weight, a bias) as an fp32 torch tensor of its own."""
        tensor = self.tensors[name]
        if tensor.type_id not in (F32, F16):
            raise SpecdecError(f"GGUF tensor {name} is {_type_name(tensor.type_id)}, expected F32 or F16")
        values = self.blocks(name).view(np.float32 if tensor.type_id == F32 else np.float16)
        return torch.from_numpy(values.astype(np.float32))  # a copy, writable


def _type_name(type_id: int) -> str:
    if type_id in NAMES:
        return NAMES[type_id]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"type {type_id}"


# ---------------------------------------------------------------- the architectures: what every tensor and key means

# A metadata key's check: (the file, the key's value) -> why the gguf target cannot run a file with that value
# (None: it can)
Check = Callable[["GGUFFile", Any], "str | None"]
OTHER_KEYS = ("general.", "tokenizer.", "quantize.", "split.")  # metadata outside the model's math
INSTEAD = "use --dtype int8 or the llama.cpp backend"  # what a refusal points to


def _head_dim(file: GGUFFile) -> int:
    """A head's size: attention.key_length where the file says, else hidden // heads."""
    return int(file.get("attention.key_length") or int(file.get("embedding_length")) // int(file.get("attention.head_count")))


def _whole_rotary(file: GGUFFile, value: Any) -> str | None:
    return None if int(value) == _head_dim(file) else f"rotates {value} of each head's {_head_dim(file)} values " \
                                                       "(partial rotary embedding), which the gguf target does not"


def _same_value_size(file: GGUFFile, value: Any) -> str | None:
    return None if int(value) == _head_dim(file) else "has value heads of another size than its key heads"


def _linear_rope(file: GGUFFile, value: Any) -> str | None:
    return None if value in ("none", "linear") else f"uses '{value}' rotary scaling, which the gguf target does not compute"


def _general_type(file: GGUFFile, value: Any) -> str | None:
    return None if value == "model" else f"is a '{value}', not a model"


def _no_experts(file: GGUFFile, value: Any) -> str | None:
    return None if not value else "has mixture-of-experts layers, which the gguf target does not compute"


# the keys (after "<arch>.") every architecture's config reads or knows change nothing
COMMON_KEYS: dict[str, Check | None] = {
    "context_length": None, "embedding_length": None, "block_count": None, "feed_forward_length": None,
    "vocab_size": None, "attention.head_count": None, "attention.head_count_kv": None,
    "attention.layer_norm_rms_epsilon": None, "attention.key_length": None, "attention.value_length": _same_value_size,
    "rope.freq_base": None, "rope.dimension_count": _whole_rotary, "rope.scaling.type": _linear_rope,
    "rope.scaling.factor": None, "rope.scaling.original_context_length": None, "rope.scaling.finetuned": None,
    "expert_count": _no_experts, "expert_used_count": _no_experts,
}
LLAMA_LAYER = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
               "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@dataclass(frozen=True)
class Architecture:
    """How the gguf target runs one GGUF architecture (general.architecture), and what it runs of it: every
    tensor a file of it may hold and every metadata key under its name.  A file with a tensor or a key outside
    these, or a key's value that its check refuses, is refused in one line (:func:`account`): the gguf target
    never runs a file as a model other than the one its author wrote (llama.cpp's reading of it)."""

    name: str  # general.architecture
    model_type: str  # transformers' model_type of the config
    layer_tensors: tuple[str, ...] = LLAMA_LAYER  # each layer's tensors (after "blk.<i>."), all needed
    optional_layer_tensors: tuple[str, ...] = ()  # those a layer may have (qwen2's q / k / v biases)
    optional_tensors: tuple[str, ...] = ()  # the model's besides token_embd, output_norm and output
    keys: Mapping[str, Check | None] = field(default_factory=dict)  # its own keys besides COMMON_KEYS
    permuted_qk: bool = False  # q / k rows in llama.cpp's interleaved rotary layout (undone at packing)
    qkv: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")  # the tensors whose rows make q, k and v, in order
    gate_up: tuple[str, ...] = ("ffn_gate", "ffn_up")  # those whose rows make the gate's and the up projection's
    act: str = "silu"  # the gate's activation (lean.ACTIVATIONS' name)
    embed_scaled: bool = False  # the embedding's rows times sqrt(hidden) (Gemma)
    # its own config values (set in place on the common ones: config_values), where it has some
    config: Callable[[GGUFFile, dict[str, Any]], None] | None = None

    def all_keys(self) -> dict[str, Check | None]:
        return {**COMMON_KEYS, **self.keys}


GEMMA3_LOCAL_BASE = 10_000.0  # the rotary base of Gemma 3's sliding-window layers (llama.cpp's and transformers')
GEMMA3_PATTERN = 6  # every 6th Gemma 3 layer attends globally, the others in a sliding window


def _gemma3_config(file: GGUFFile, values: dict[str, Any]) -> None:
    """Gemma 3's config values (Gemma3TextConfig's names) from its file as llama.cpp reads it: a sliding window
    on five layers of six (or the file's attention.sliding_window_pattern: a period, or one flag a layer),
    their rotary base 10,000 unscaled, the global layers' the file's (with its linear scaling), the attention
    scaled by 1 / sqrt(head_dim) -- llama.cpp's rule, which gives the 27B model (62 layers) 1 / sqrt(hidden /
    heads) -- and a tanh-GELU gate.  Its norms' weights are stored as 1 + w by llama.cpp's converter: the factors
    they scale by, as the native layers take them."""
    layers = values["num_hidden_layers"]
    pattern = file.get("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    if len(sliding) != layers:
        raise SpecdecError(f"--dtype gguf: {file.path.name}'s attention.sliding_window_pattern has {len(sliding)} "
                           f"flags for {layers} layers")
    values["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    values["sliding_window"] = int(file.get("attention.sliding_window", 4096))
    values["head_dim"] = _head_dim(file)
    heads = values["num_attention_heads"]
    values["query_pre_attn_scalar"] = values["hidden_size"] // heads if layers == 62 else values["head_dim"]
    values["rope_parameters"] = {"full_attention": values["rope_parameters"],
                                 "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_BASE}}
    values["hidden_activation"] = "gelu_pytorch_tanh"
    values["final_logit_softcapping"] = values["attn_logit_softcapping"] = None


def _qwen3_config(file: GGUFFile, values: dict[str, Any]) -> None:
    """Qwen 3's head size is its own (attention.key_length; Qwen3Config's default is 128 whatever the width); its
    other values as Qwen3Config sets them (no sliding window: llama.cpp's qwen3 has none)."""
    values["head_dim"] = _head_dim(file)
    values.update(hidden_act="silu", use_sliding_window=False, max_window_layers=28,
                  layer_types=["full_attention"] * values["num_hidden_layers"])


def _phi3_config(file: GGUFFile, values: dict[str, Any]) -> None:
    """Phi-3's values as Phi3Config names them.  Its sliding window (attention.sliding_window) is not applied:
    llama.cpp disables Phi's (its converters do not say which layers have one), and the file's model is llama.cpp's;
    the window only matters past its length (2047 tokens for Phi-3-mini-4k)."""
    values.update(hidden_act="silu", sliding_window=None, partial_rotary_factor=1.0,
                  original_max_position_embeddings=values["max_position_embeddings"])
    values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": 1.0}


def _gemma2_config(file: GGUFFile, values: dict[str, Any]) -> None:
    """Gemma 2's config values (Gemma2Config's names) from its file as llama.cpp reads it: a sliding window on
    every other layer (the even ones), one rotary table, the attention scaled by 1 / sqrt(head_dim) -- 1 /
    sqrt(hidden / heads) for the 27B model (46 layers), llama.cpp's rule -- its scores and the final logits
    soft-capped (c * tanh(x / c)) where the file says, a tanh-GELU gate; norms stored as 1 + w, as Gemma 3's."""
    layers = values["num_hidden_layers"]
    values["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    values["sliding_window"] = int(file.get("attention.sliding_window", 4096))
    values["head_dim"] = _head_dim(file)
    heads = values["num_attention_heads"]
    values["query_pre_attn_scalar"] = values["hidden_size"] // heads if layers == 46 else values["head_dim"]
    values["hidden_activation"] = "gelu_pytorch_tanh"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = file.get(key)
        values[key] = float(cap) if cap else None


LLAMA_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
ARCHS: dict[str, Architecture] = {arch.name: arch for arch in (
    Architecture("llama", "llama", permuted_qk=True, optional_tensors=("rope_freqs.weight",)),
    Architecture("mistral", "mistral", permuted_qk=True, keys={"attention.sliding_window": None}),
    Architecture("qwen2", "qwen2", optional_layer_tensors=LLAMA_BIASES),
    Architecture("qwen3", "qwen3", layer_tensors=(*LLAMA_LAYER, *QK_NORMS), config=_qwen3_config),
    Architecture("phi3", "phi3", qkv=("attn_qkv",), gate_up=("ffn_up",), config=_phi3_config,
                 layer_tensors=("attn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_norm.weight",
                                "ffn_up.weight", "ffn_down.weight"),
                 keys={"attention.sliding_window": None}),
    Architecture("gemma2", "gemma2", act="gelu_pytorch_tanh", embed_scaled=True, config=_gemma2_config,
                 layer_tensors=(*LLAMA_LAYER, "post_attention_norm.weight", "post_ffw_norm.weight"),
                 keys={"attention.sliding_window": None, "attn_logit_softcapping": None,
                       "final_logit_softcapping": None}),
    Architecture("gemma3", "gemma3_text", act="gelu_pytorch_tanh", embed_scaled=True, config=_gemma3_config,
                 layer_tensors=(*LLAMA_LAYER, *QK_NORMS, "post_attention_norm.weight", "post_ffw_norm.weight"),
                 keys={"attention.sliding_window": None, "attention.sliding_window_pattern": None}),  # (_gemma3_config's)
)}
ARCHITECTURES = tuple(ARCHS)  # GGUF general.architecture values the gguf target runs


def architecture(file: GGUFFile) -> Architecture:
    """The file's Architecture, after accounting for every tensor and metadata key of it (:func:`account`)."""
    arch = ARCHS.get(file.architecture)
    if arch is None:
        raise SpecdecError(f"--dtype gguf runs {'/'.join(ARCHITECTURES)} GGUF models, and {file.path.name} is a "
                           f"'{file.architecture or 'unknown'}' model: {INSTEAD}")
    account(file, arch)
    return arch


def account(file: GGUFFile, arch: Architecture) -> None:
    """Refuse, in one line, a file with a tensor or a metadata key that `arch` does not account for, or a key's
    value it does not compute (its check's reason): a tensor the gguf target would leave out or a key it would
    ignore would make it run another model than the file's."""
    keys = arch.all_keys()
    prefix = f"{arch.name}."
    for key, value in file.metadata.items():
        if key.startswith(prefix) and key[len(prefix):] in keys:
            check = keys[key[len(prefix):]]
        elif key.startswith(OTHER_KEYS) and key != "general.type":
            continue
        elif key == "general.type":
            check = _general_type
        else:
            raise SpecdecError(f"--dtype gguf: {file.path.name} has the metadata key {key} (= {_short(value)}), "
                               f"which the gguf target does not compute for a {arch.name} model: {INSTEAD}")
        reason = check(file, value) if check is not None else None
        if reason:
            raise SpecdecError(f"--dtype gguf: {file.path.name} {reason} ({key} = {_short(value)}): {INSTEAD}")
    layers = int(file.get("block_count", 0))
    known = {"token_embd.weight", "output_norm.weight", "output.weight", *arch.optional_tensors}
    known |= {f"blk.{i}.{name}" for i in range(layers) for name in (*arch.layer_tensors, *arch.optional_layer_tensors)}
    unknown = sorted(set(file.tensors) - known)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise SpecdecError(f"--dtype gguf: {file.path.name} has the tensor {unknown[0]}{more}, which the gguf target "
                           f"does not compute for a {arch.name} model: {INSTEAD}")


def _short(value: Any) -> str:
    """A metadata value for a one-line message (a long list cut)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- the config


def config_values(file: GGUFFile) -> dict[str, Any]:
    """The transformers config values of a GGUF file of ARCHITECTURES, from its metadata (as transformers' own GGUF
    loader maps it; a one-line SpecdecError for an architecture, a tensor or a key the gguf target lacks:
    :func:`architecture`): the arguments of the architecture's config class."""
    architecture_ = architecture(file)
    arch = architecture_.name
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise SpecdecError(f"GGUF file {file.path.name} has no token_embd.weight")
    heads = int(file.get("attention.head_count"))
    hidden = int(file.get("embedding_length"))
    values: dict[str, Any] = dict(
        vocab_size=embed.rows, hidden_size=hidden, intermediate_size=int(file.get("feed_forward_length")),
        num_hidden_layers=int(file.get("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(file.get("attention.head_count_kv", heads)),
        max_position_embeddings=int(file.get("context_length", 4096)),
        rms_norm_eps=float(file.get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=file.metadata.get("tokenizer.ggml.padding_token_id"))
    head_dim = file.get("attention.key_length")
    if head_dim is not None and int(head_dim) != hidden // heads:
        values["head_dim"] = int(head_dim)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(file.get("rope.freq_base", 10000.0))}
    if file.get("rope.scaling.type") == "linear":  # any other but none: refused by account()
        rope = {**rope, "rope_type": "linear", "factor": float(file.get("rope.scaling.factor", 1.0))}
    values["rope_parameters"] = rope
    window = file.get("attention.sliding_window")
    if arch == "mistral":
        values["sliding_window"] = int(window) if window else None
    if architecture_.config is not None:
        architecture_.config(file, values)
    return {k: v for k, v in values.items() if v is not None}


def config_of(file: GGUFFile, name: str = "") -> ModelConfig:
    """The config of a GGUF file of ARCHITECTURES (config_values) as the gguf target reads it: the attributes
    transformers' config of the architecture would have, without transformers (modelconfig.model_config's for
    llama / qwen2 / mistral; the values as they are for the others, whose config_values set every one read)."""
    values = config_values(file)
    model_type = ARCHS[file.architecture].model_type
    config = model_config({**values, "model_type": model_type}, name or str(file.path))
    if config is not None:
        return config
    assert model_type not in ("llama", "qwen2", "mistral")  # (config_values refuses what model_config does not cover)
    read: dict[str, Any] = {f.name: values.get(f.name) for f in fields(ModelConfig)
                            if f.name not in ("model_type", "_name_or_path")}
    read["num_key_value_heads"] = values.get("num_key_value_heads", values["num_attention_heads"])
    return ModelConfig(model_type=model_type, _name_or_path=name or str(file.path), **read)


def transformers_config_of(file: GGUFFile, name: str = "") -> Any:
    """transformers' config of a GGUF file of ARCHITECTURES (config_values): for its model on the meta device
    (GGUFRunner.model)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(ARCHS[file.architecture].model_type, **config_values(file))
    config._name_or_path = name or str(file.path)
    return config


# ---------------------------------------------------------------- the weights


def _unpermute(rows: int, heads: int) -> list[int]:
    """The file's row of each output channel of a llama q or k projection: llama.cpp's converter interleaves each
    head's two rotary halves (row 2 i + j of a head holds channel j * half + i); transformers' rotate-half
    layout wants them back in halves."""
    dim = rows // heads // 2
    return [h * 2 * dim + 2 * i + j for h in range(heads) for j in range(2) for i in range(dim)]


class _Arena:
    """One memory block for a model's packed weights, backed by transparent huge pages where the kernel allows
    (madvise): a decode step streams through all of it, and 2 MiB pages spare the TLB misses of 4 KiB ones (a
    2-core Zen 4 read 34.5 GB/s from huge pages against 31.8 from small ones).  take() hands out each tensor's
    slice in turn, 4 KiB aligned."""

    ALIGN = 4096
    HUGE = 2 << 20

    def __init__(self, shapes: Sequence[tuple[int, int, int]], packed: torch.Tensor | None = None) -> None:
        """shapes: the packed tensors' (type id, rows, columns) in the order take() hands them out.  packed: the
        arena's bytes as an earlier load packed them (a memory-mapped cache file, see
        specdec.native.packcache; `filled`), else an empty block to pack into."""
        import mmap

        sizes = [-(-kernels.gguf.packed_bytes(*shape) // self.ALIGN) * self.ALIGN for shape in shapes]
        self.used = sum(sizes)
        self.filled = packed is not None and packed.dtype == torch.uint8 and packed.numel() == self.used
        if self.filled:
            assert packed is not None
            self._bytes, self._at, self.nbytes = packed, 0, self.used
            return
        total = self.used + self.HUGE
        self._map = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without transparent huge pages: small pages, the same numbers
                pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # [total], shares the mapping
        self._at = -self._bytes.data_ptr() % self.HUGE  # the first 2 MiB boundary
        self._start = self._at
        self.nbytes = total

    def packed(self) -> torch.Tensor:
        """The packed tensors' bytes, as a later load takes them back (the `packed` argument)."""
        start = 0 if self.filled else self._start
        return self._bytes[start : start + self.used]

    def take(self, type_id: int, rows: int, columns: int) -> torch.Tensor:
        size = kernels.gguf.packed_bytes(type_id, rows, columns)
        out = self._bytes[self._at : self._at + size]
        self._at += -(-size // self.ALIGN) * self.ALIGN
        return out


class GGUFModel:
    """A GGUF model's weights as the gguf target runs them: each layer's linears packed for the block kernel
    (q, k, v side by side in one call; gate and up too), norms and biases in fp32, the output head packed, the
    token embedding left in the mapped file (a step reads only its tokens' rows).  Built once per file and
    shared by every runner over it.

    requantize: a ggml type id (Q4_1) to store every linear and the head in instead of the file's own blocks: a
    draft's weights in fewer bytes (specdec.native.int4.q4_1_blocks: the file's de-quantised values in 4 bits
    with an fp16 scale and minimum per 32 columns); never a target's (its numbers are its output)."""

    def __init__(self, file: GGUFFile, name: str = "", requantize: int | None = None) -> None:
        if requantize not in (None, Q4_1):
            raise ValueError(f"the gguf model requantises to Q4_1 only, not type {requantize}")
        self.file = file
        self.config = config_of(file, name)
        self.values = config_values(file)  # the architecture's own values too (Gemma's query_pre_attn_scalar)
        self.name = name or str(file.path)
        self.requantize = requantize
        self.dtype = "gguf" if requantize is None else "q4_1"
        c = self.config
        self.num_heads, self.num_kv_heads, self.head_dim = attention_shape(c)
        self.hidden, self.intermediate = c.hidden_size, c.intermediate_size
        self.embed = file.tensors["token_embd.weight"]
        if self.embed.type_id not in (F32, F16):  # rows are read from the file as they are
            self._check(self.embed)
        self.arch = ARCHS[file.architecture]  # (config_of accounted for the file's every tensor and key)
        llama = self.arch.permuted_qk
        q_order = _unpermute(self.num_heads * self.head_dim, self.num_heads) if llama else None
        k_order = _unpermute(self.num_kv_heads * self.head_dim, self.num_kv_heads) if llama else None
        # per layer its four linears' (stem, channel order) lists; then the head
        plan: list[list[list[tuple[str, list[int] | None]]]] = []
        for i in range(c.num_hidden_layers):
            blk = f"blk.{i}."
            orders = {"attn_q": q_order, "attn_k": k_order}  # (a fused attn_qkv is never permuted)
            plan.append([[(blk + stem, orders.get(stem)) for stem in self.arch.qkv], [(blk + "attn_output", None)],
                         [(blk + stem, None) for stem in self.arch.gate_up], [(blk + "ffn_down", None)]])
        self._head_stem = "output" if "output.weight" in file.tensors else "token_embd"
        head = [(self._head_stem, None)]
        self._check_shapes(plan)
        stems = [stem for layer in plan for linear in layer for stem, _ in linear] + [head[0][0]]
        # a split model's later parts key its packed bytes too (the first part's path names the cache file)
        parts = {"parts": [file_identity(part) for part in file.paths[1:]]} if len(file.paths) > 1 else None
        cache = cache_for("gguf" if requantize is None else f"gguf-{self.dtype}", file.path, parts)
        self._arena = _Arena([self._shape(self._tensor(stem)) for stem in stems],
                             None if cache is None else cache.get("arena"))
        layers = []
        self.rope_kinds = _rope_kinds(c)
        for i, (qkv, o, gate_up, down) in enumerate(plan):
            layers.append(_Layer(
                input_norm=self.vector(f"blk.{i}.attn_norm.weight"), qkv=self._parts(qkv), o=self._parts(o),
                post_norm=self.vector(f"blk.{i}.ffn_norm.weight"), gate_up=self._parts(gate_up),
                down=self._parts(down), **self._layer_extras(i)))
        self.layers = layers
        self.final_norm = self.vector("output_norm.weight")
        self.head = self._parts(head)
        self.head.rows_of = self.head_rows  # a trimmed vocabulary's head is its rows packed anew
        if self._arena.filled:
            assert cache is not None
            cache.prefault()
            return  # the file's pages of the packed tensors were never touched
        file.release(sorted({stem + ".weight" for stem in stems} - {self.embed.name}))  # the embedding's rows are read
        if cache is not None:
            cache.tensor("arena", self._arena.packed)
            cache.save()  # in the background: the next load maps it

    def _layer_extras(self, i: int) -> dict[str, Any]:
        """Layer i's attention scale, sliding window and rotary table, and the norms its architecture has besides
        the input and pre-MLP ones (_Layer's fields; the file's vectors as they are: Gemma's hold 1 + w)."""
        c, blk, tensors = self.config, f"blk.{i}.", self.file.tensors
        types = c.layer_types
        window = c.sliding_window if types is None or types[i] == "sliding_attention" else None
        scalar = self.values.get("query_pre_attn_scalar", self.head_dim)  # Gemma's; else the head's size
        extras: dict[str, Any] = dict(scaling=float(scalar ** -0.5), sliding_window=window,
                                      rope=0 if types is None or self.rope_kinds == [None]
                                      else self.rope_kinds.index(types[i]))
        for name, stem, length in (("q_norm", "attn_q_norm", self.head_dim), ("k_norm", "attn_k_norm", self.head_dim),
                                   ("attn_out_norm", "post_attention_norm", None),
                                   ("mlp_out_norm", "post_ffw_norm", None)):
            if blk + stem + ".weight" in tensors:  # (the architecture's: account() refused any other)
                extras[name] = self.vector(blk + stem + ".weight", length)
        return extras

    def rotary(self) -> tuple[FileRotary | RotaryTables, list[str | None]]:
        """The rotary module of the model's tables (one, or one per layer type: Gemma 3's) and their kinds, in
        the order its layers' `rope` index them; with the file's rope_freqs.weight (Llama 3's factors) where it
        has one."""
        factors = self.vector("rope_freqs.weight", self.head_dim // 2) if "rope_freqs.weight" in self.file.tensors \
            else None
        rope = self.config.rope_parameters
        if self.rope_kinds == [None]:
            return FileRotary(rope, self.head_dim, factors), self.rope_kinds
        tables = {kind: FileRotary(rope[kind], self.head_dim, factors) for kind in self.rope_kinds if kind is not None}
        return RotaryTables(cast(dict[str, Rotary], tables)), self.rope_kinds

    def _check_shapes(self, plan: Sequence[Sequence[Sequence[tuple[str, Any]]]]) -> None:
        """Refuse, in one line, a linear whose shape is not the config's (the kernels would read past it)."""
        q, kv, hidden, inner = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden, \
            self.intermediate
        shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
                  "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner),
                  "output": (self.embed.rows, hidden), "token_embd": (self.embed.rows, hidden),
                  "attn_qkv": (q + 2 * kv, hidden)}  # q, k and v in one tensor (phi3)
        if self.arch.gate_up == ("ffn_up",):  # the gate's rows and then the up projection's in one tensor (phi3)
            shapes["ffn_up"] = (2 * inner, hidden)
        stems = [stem for layer in plan for linear in layer for stem, _ in linear] + ["token_embd", self._head_stem]
        for stem in stems:
            tensor = self.file.tensors.get(stem + ".weight")
            expected = shapes[stem.rsplit(".", 1)[-1]]
            if tensor is not None and (tensor.rows, tensor.columns) != expected:
                raise SpecdecError(f"--dtype gguf: {self.file.path.name}'s {tensor.name} is {tensor.rows} x "
                                   f"{tensor.columns}, and its config makes it {expected[0]} x {expected[1]}")

    def vector(self, name: str, length: int | None = None) -> torch.Tensor:
        """The F32 / F16 vector `name` (a norm's weight, a bias) [length] fp32, checked: `length` values (None:
        hidden)."""
        if name not in self.file.tensors:
            raise SpecdecError(f"GGUF file {self.file.path.name} has no {name}")
        values = self.file.float_tensor(name)
        if values.numel() != (length or self.hidden):
            raise SpecdecError(f"--dtype gguf: {self.file.path.name}'s {name} has {values.numel()} values, and its "
                               f"config makes it {length or self.hidden}")
        return values

    def _tensor(self, stem: str) -> Tensor:
        """The weight of linear `stem` (checked: a type and shape the block kernel multiplies, or de-quantises where
        it requantises)."""
        tensor = self.file.tensors.get(stem + ".weight")
        if tensor is None:
            raise SpecdecError(f"GGUF file {self.file.path.name} has no {stem}.weight")
        if self.requantize is None or tensor.type_id not in (F32, F16):
            self._check(tensor)
        return tensor

    def _shape(self, tensor: Tensor) -> tuple[int, int, int]:
        """(type id, rows, columns) of `tensor` as packed: its own type, or the one it is requantised to."""
        return (tensor.type_id if self.requantize is None else self.requantize, tensor.rows, tensor.columns)

    def _check(self, tensor: Tensor) -> None:
        """A one-line SpecdecError for a matrix the kernel cannot multiply: a type it lacks (IQ2_XXS, TQ1_0, ...),
        or rows that are not whole blocks of their type; what to run the file with instead."""
        instead = ("run it with --backend llamacpp, or --dtype int8 (its weights de-quantised and re-quantised "
                   "to int8 through transformers)")
        where = f"--dtype gguf: {self.file.path.name}'s {tensor.name} is {_type_name(tensor.type_id)}"
        if not kernels.gguf.supported(tensor.type_id):
            raise SpecdecError(f"{where}, which the gguf target does not multiply (it multiplies "
                               f"{', '.join(NAMES.values())}): {instead}")
        if tensor.columns % BLOCK.get(tensor.type_id, 1):
            raise SpecdecError(f"{where} with rows of {tensor.columns} values, not whole {BLOCK[tensor.type_id]}-value "
                               f"blocks, which the gguf target does not multiply: {instead}")

    def _blocks(self, tensor: Tensor) -> tuple[int, np.ndarray | torch.Tensor]:
        """(type id, blocks) of `tensor` as packed: the file's own, or its values requantised (rows in the file's
        order, a few thousand at a time)."""
        if self.requantize is None:
            return tensor.type_id, self.file.blocks(tensor.name)
        from specdec.native.int4 import q4_1_blocks

        out = []
        for lo in range(0, tensor.rows, REQUANTIZE_ROWS):
            out.append(q4_1_blocks(self.float_rows(tensor, range(lo, min(lo + REQUANTIZE_ROWS, tensor.rows)))))
        return self.requantize, torch.cat(out)

    def float_rows(self, tensor: Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Rows `rows` of `tensor` [len(rows), columns] fp32: the file's de-quantised values."""
        if tensor.type_id in (F32, F16):
            table = self.file.blocks(tensor.name).view(np.float32 if tensor.type_id == F32 else np.float16)
            return torch.from_numpy(table.reshape(tensor.rows, -1)[list(rows)].astype(np.float32))
        return kernels.gguf.rows(tensor.type_id, self.file.blocks(tensor.name), tensor.columns, list(rows))

    def _parts(self, names: Sequence[tuple[str, list[int] | None]]) -> Parts:
        """The linears `names` (without ".weight") side by side as one Parts, each packed into the arena in the
        given channel order (its bias, where the file has one, in the same order)."""
        parts = []
        for stem, order in names:
            tensor = self._tensor(stem)
            type_id = self._shape(tensor)[0]
            packed = self._arena.take(*self._shape(tensor))
            if not self._arena.filled:
                kernels.gguf.pack(*self._blocks(tensor), tensor.rows, tensor.columns, order, out=packed)
            bias = self.vector(stem + ".bias", tensor.rows) if stem + ".bias" in self.file.tensors else None
            if bias is not None and order is not None:
                bias = bias[torch.tensor(order)].contiguous()
            parts.append(Part(packed, type_id, tensor.rows, bias))
        return Parts(parts, self._tensor(names[0][0]).columns)

    def head_rows(self, ids: Sequence[int]) -> Parts:
        """The output head restricted to vocabulary ids `ids` (its rows, packed anew in that order: a draft's head
        over a trimmed vocabulary, FR-Spec): logit j of a row is bitwise the full head's logit ids[j] (the kernel
        computes each output channel from its own weights and the row; a requantised head's rows are requantised
        alone, each row's blocks its own)."""
        tensor = self._tensor(self._head_stem)
        order = [int(i) for i in ids]
        if self.requantize is None:
            type_id = tensor.type_id
            packed = kernels.gguf.pack(type_id, self.file.blocks(tensor.name), tensor.rows, tensor.columns, order)
        else:
            from specdec.native.int4 import q4_1_blocks

            type_id = self.requantize
            packed = kernels.gguf.pack(type_id, q4_1_blocks(self.float_rows(tensor, order)), len(order), tensor.columns)
        return Parts([Part(packed, type_id, len(order))], tensor.columns, rows_of=self.head_rows)

    def embedding(self, tokens: Sequence[int]) -> torch.Tensor:
        """The token embedding's rows [n, hidden] fp32: the file's de-quantised values."""
        return self.float_rows(self.embed, tokens)

    def nbytes(self) -> int:
        """Bytes of the model in memory: the packed weights' block (the embedding stays in the mapped file)."""
        return self._arena.nbytes


# The gate activations of the gguf target in kernels/layers.c (ACT_*): SiLU, and the tanh-GELU as llama.cpp computes
# it (ACT_GELU_FP16: ggml's fp16 table, the gate and its GELU rounded to fp16 for |g| < 10; transformers' fp32
# GELU, lean.ACTIVATIONS' code, was 3.6e-4 from llama.cpp's on gemma3-270m's first layer).
FILE_ACTIVATIONS = {"silu": ACTIVATIONS["silu"], "gelu_pytorch_tanh": 2}


class FileRotary:
    """A GGUF model's rotary table as llama.cpp computes it (kernels.layers.rope_table: llama.cpp's iterated fp32
    angles, divided by Llama 3's `factors` where the file has them, times 1 / factor for linear scaling, their cosf
    and sinf), called as LeanRunner calls a model's rotary module: (x, position_ids [B, n]) -> (cos, sin) [B, n, D].
    With them a file's rotated q and k are llama.cpp's to an ulp (layers.c's sd_rope_table); tables made
    transformers' way (lean.Rotary) moved them by up to 1e-6 of their size, which flipped a quantised activation
    downstream now and then (tests/native/gguf_files: the distances to llama.cpp)."""

    def __init__(self, rope: Mapping[str, Any], head_dim: int, factors: torch.Tensor | None = None) -> None:
        self.base = float(rope["rope_theta"])
        linear = rope.get("rope_type") == "linear"
        self.scale = float(np.float32(1.0) / np.float32(rope["factor"])) if linear else 1.0  # llama.cpp's fp32 1 / f
        self.head_dim, self.factors = head_dim, factors

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = kernels.layers.rope_table(position_ids.reshape(-1), self.head_dim, self.base, self.scale,
                                             self.factors)  # [B n, D]
        shape = (*position_ids.shape, self.head_dim)
        return cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)


class GGUFLayers(LayerSet):
    """A GGUF model's layers in one call of kernels/layers.c on the block kernel: batch-invariant (a token's
    numbers are its own row's), token trees and tapped layers included."""

    backend = "specdec gguf"
    dtype = "gguf"
    native = True
    tree = True

    def __init__(self, model: GGUFModel) -> None:
        super().__init__(model.layers, model.head)
        self.model = model
        self.dtype = model.dtype
        if model.requantize is not None:
            self.backend = f"specdec {model.dtype} (gguf kernel)"
        self.table = _gguf_table(model.layers)
        self._kernel_model = LayersModel(
            tensors=self.table.tensors.data_ptr(), scaling=self.table.scaling.data_ptr(),
            window=self.table.window.data_ptr(), layers=len(model.layers), hidden=model.hidden,
            heads=model.num_heads, kv_heads=model.num_kv_heads, d=model.head_dim, intermediate=model.intermediate,
            act=FILE_ACTIVATIONS[model.arch.act], eps=float(model.config.rms_norm_eps),
            softcap=float(model.values.get("attn_logit_softcapping") or 0.0), linear=kernels.layers.GGUF, isa=0)

    def use_path(self, path: str | None) -> None:
        """Run every kernel on `path` ("c", "avx2" or "avx512-vnni": at most this CPU's best; None: the best), for
        tests that compare the paths."""
        self._kernel_model.isa = kernels.gguf.PATHS[path] if path else 0
        self.model.head.path = path

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.layers.rms_norm(x, weight, eps)

    def run(self, runners: Sequence[LeanRunner], starts: Sequence[int], offsets: Sequence[int], x: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, trees: Sequence[Tree | None] | None = None,
            tapped: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """In place: x is the last layer's output after the call."""
        lead = runners[0]
        x = x.contiguous()
        sizes = [hi - lo for lo, hi in zip(offsets, offsets[1:])]
        caches = [a for r in runners for a in r._addresses]  # [R * layers * 2]
        tree_addresses = None
        if trees and any(t is not None for t in trees):
            tree_addresses = [None if t is None else (t.at.data_ptr(), t.rows.data_ptr()) for t in trees]
        taps = None
        if tapped:
            for i in tapped:
                tapped[i] = torch.empty_like(x)
            taps = [tapped[i].data_ptr() if i in tapped else 0 for i in range(len(self.layers))]
        kernels.layers.run(self._kernel_model, x, starts, sizes, caches,
                           [r.capacity * lead.head_dim for r in runners], cos.contiguous(), sin.contiguous(),
                           trees=tree_addresses, taps=taps)
        return x


def _gguf_table(layers: Sequence[_Layer]) -> _NativeTable:
    """The layers as kernels/layers.c reads them with LIN_GGUF linears: per linear its parts' address and count."""
    def address(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    rows = []
    for layer in layers:
        row = [layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(lin, Parts)
            row += [lin.address, len(lin.parts), 0]
        row += [address(layer.q_norm), address(layer.k_norm), address(layer.attn_out_norm),
                address(layer.mlp_out_norm), layer.rope]  # 0: a norm the layer does not have
        rows.append(row)
    return _NativeTable(torch.tensor(rows, dtype=torch.int64), torch.tensor([layer.scaling for layer in layers]),
                        torch.tensor([layer.sliding_window or 0 for layer in layers], dtype=torch.int32))


class GGUFRunner(LeanRunner):
    """A ModelRunner over a GGUF model's own blocks (see the module doc): the lean runner's cache, rollback,
    trees, hidden states and packed forwards, with :class:`GGUFLayers`.  It needs no transformers model: the
    file's config, the rotary tables (Rotary) and the end-of-sequence ids are its own; `model` (transformers'
    model of the config on the meta device: structure and generation config, no weights) is built when asked."""

    layer_set: GGUFLayers

    def __init__(self, model: GGUFModel, max_context: int | None = None, layer_set: GGUFLayers | None = None) -> None:
        self.gguf = model
        self.layer_set = layer_set or GGUFLayers(model)
        config = model.config
        self._meta: Any = None
        rotary, kinds = model.rotary()
        # Gemma scales its embedding's rows by sqrt(hidden) (transformers' fp32 0-d tensor, llama.cpp's float)
        embed_scale = torch.tensor(model.hidden ** 0.5) if model.arch.embed_scaled else None
        self._setup(
            embed_rows=model.embed.rows, embed_scale=embed_scale, final_norm=model.final_norm,
            eps=float(config.rms_norm_eps), num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim, max_context=max_context or int(config.max_position_embeddings),
            rotary=rotary, rope_kinds=kinds, logit_softcap=model.values.get("final_logit_softcapping"))
        # kernels/draft.c's chain: one rotary table, unscaled embedding rows, uncapped logits
        self.capabilities = replace(self.capabilities, draft_chain=kinds == [None] and embed_scale is None
                                    and self.logit_softcap is None)
        self._chain: tuple[Any, Parts, torch.Tensor] | None = None  # (head, its Parts, ids): _chain_head's

    @property
    def model(self) -> Any:
        """transformers' model of the file's config on the meta device (built at the first call)."""
        if self._meta is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                self._meta = AutoModelForCausalLM.from_config(transformers_config_of(self.gguf.file, self.gguf.name))
        return self._meta

    @model.setter
    def model(self, value: Any) -> None:
        self._meta = value

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The config's end-of-sequence ids (what the generation config of its transformers model holds)."""
        return eos_id_set(self.gguf.config.eos_token_id)

    def embed_tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.gguf.embedding(tokens)

    def draft_greedy(self, feed: Sequence[int], k: int) -> list[int]:
        """Feed `feed`, then draft k tokens greedily, in one native call (kernels/draft.c; Capabilities.draft_chain):
        the tokens forward() and an argmax of each last row would give one at a time.  The cache then holds feed
        and the first k - 1 drafted tokens (the last one is not fed)."""
        feed = self._check(feed)
        if k < 1:
            raise ValueError(f"draft_greedy needs k >= 1, got {k}")
        start = len(self.tokens)
        if start + len(feed) + k - 1 > self.max_context:
            raise SpecdecError(f"context of {start + len(feed) + k - 1} tokens exceeds the model's window of "
                               f"{self.max_context}")
        self._reserve(start + len(feed) + k - 1)
        model = self.gguf
        table = model.file.blocks(model.embed.name)
        head, ids = self._chain_head()
        out = kernels.layers.draft_greedy(
            self.layer_set._kernel_model, self._addresses, self.capacity * self.head_dim, self._cos[0], self._sin[0],
            self.final_norm, (head.address, len(head.parts), head.out_features), ids,
            (model.embed.type_id, table.ctypes.data, model.embed.rows), feed, start, k)
        self.tokens.extend(feed + out[: k - 1])
        self._hidden = self._tail = None
        return out

    def _chain_head(self) -> tuple[Parts, torch.Tensor | None]:
        """The head draft_greedy multiplies, as one Parts (a trimmed head's set and extra ids side by side), and
        its columns' token ids (int32 [N], None for the whole vocabulary): made once per head."""
        head = self.head
        if isinstance(head, Parts):
            return head, None
        assert isinstance(head, TrimmedHead)  # a GGUF model's head is Parts, or a trimmed one over its rows
        if self._chain is None or self._chain[0] is not head:
            assert self.head_ids is not None
            parts = [part for piece in head.parts for part in cast(Parts, piece).parts]  # a GGUF head's rows: Parts
            self._chain = (head, Parts(parts, head.in_features), self.head_ids.to(torch.int32).contiguous())
        return self._chain[1], self._chain[2]

    def clone(self) -> GGUFRunner:
        twin = GGUFRunner(self.gguf, self.max_context, layer_set=self.layer_set)
        twin.trim_head(None if self._fixed is None else self._fixed.ids)
        return twin

    def identity(self) -> dict[str, Any]:
        from specdec.native.kernels.build import version

        return self._trimmed_identity({"backend": type(self).__name__, "model": self.gguf.name,
                                       "dtype": self.gguf.dtype, "device": "cpu", "threads": torch.get_num_threads(),
                                       "kernel": version()})


def load(path: str | Path, name: str = "", max_context: int | None = None, requantize: int | None = None) -> GGUFRunner:
    """A GGUFRunner over the GGUF file at `path` (`name`: what the runner reports as its model, e.g. a zoo name;
    requantize: Q4_1 for a draft's weights in 4 bits, see GGUFModel)."""
    return GGUFRunner(GGUFModel(GGUFFile(path), name, requantize), max_context=max_context)
