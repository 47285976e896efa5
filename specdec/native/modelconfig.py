"""A model's config as specdec's own runners read it, and what they read of a model, without transformers.

Importing ``transformers`` costs more than half a second at every start (its package scans every model
folder), and building a config with it costs its configuration code besides.  The gguf target
(:mod:`specdec.native.gguf`) and a saved int8 draft (:mod:`specdec.native.skeleton`) run on the lean
runner (:mod:`specdec.native.lean`), which reads a few attributes of the config: :class:`ModelConfig` holds
exactly those, built by :func:`model_config` from a config's values (a ``config.json``, or a GGUF file's
metadata mapped to transformers' names) as transformers 5's config classes of the llama, qwen2 and mistral
architectures set them -- their defaults for missing keys, the kv heads and head size they derive, qwen2's
sliding window and layer types, the legacy ``rope_theta`` / ``rope_scaling`` keys standardised into
``rope_parameters`` -- the same values of the same types (tested against transformers' configs).  What it
does not cover (another architecture, rotary parameters per layer type or with another scaling than the
default and linear ones the lean runner computes) gives None, and the caller takes transformers' config.

The helpers here read a model (transformers' or specdec's module tree with such a config) as every runner
does: its attention's shape, end-of-sequence ids, longest context, identity and layers' sliding windows.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

# transformers 5's defaults of the config classes of the architectures covered (Llama/Qwen2/MistralConfig)
_SHARED: dict[str, Any] = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
                               rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=None)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_SHARED, vocab_size=32000, intermediate_size=11008, num_key_value_heads=None, head_dim=None,
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(_SHARED, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                  max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  layer_types=None, bos_token_id=None, eos_token_id=None),
    "mistral": dict(_SHARED, vocab_size=32000, intermediate_size=14336, num_key_value_heads=8, head_dim=None,
                    max_position_embeddings=4096 * 32, sliding_window=4096, bos_token_id=1, eos_token_id=2),
}
DEFAULT_THETA = 10_000.0  # RotaryEmbeddingConfigMixin.default_theta (none of the three overrides it)
COVERED_ROPE = ("default", "linear")  # the rotary scalings lean.Rotary computes
# the layer types transformers renames (remap_legacy_layer_types)
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                       "deepseek_sparse_attention": "indexed_attention", "qwen_sparse_attention": "indexed_attention"}
_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")  # the attention the lean runner computes
# the types of the config classes' fields that are not ints (None besides, where nullable; see _valid)
_TYPES = {"hidden_act": str, "rms_norm_eps": float, "tie_word_embeddings": bool, "use_sliding_window": bool,
          "layer_types": list}
# ModelConfig's attributes taken as the config class sets them (the others: model_type, rope_parameters,
# layer_types, _name_or_path)
_READ = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
         "tie_word_embeddings", "sliding_window", "use_sliding_window", "max_window_layers", "bos_token_id",
         "eos_token_id", "pad_token_id")


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """The attributes of a llama / qwen2 / mistral config that the lean runner, the gguf target and the saved
    int8 draft read, valued as transformers' config of the same values has them (None where transformers'
    config has no such attribute: qwen2's head_dim unless given, llama's sliding window...)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any]
    sliding_window: int | None
    use_sliding_window: bool | None
    max_window_layers: int | None
    layer_types: list[str] | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    _name_or_path: str = ""


def model_config(values: Mapping[str, Any], name: str = "") -> ModelConfig | None:
    """The ModelConfig of a config's `values` (with its model_type) as transformers' config class builds it
    from them (AutoConfig.for_model / from_pretrained; `name`: its _name_or_path), or None where it is not
    covered (see the module doc)."""
    arch = values.get("model_type")
    if arch not in DEFAULTS or (arch == "mistral" and "layer_types" in values):
        return None  # (a mistral config with layer types is a ministral one to AutoConfig.from_pretrained)
    v = {**DEFAULTS[arch], **copy.deepcopy(dict(values))}  # transformers standardises its arguments in place
    if not _valid(v, arch):
        return None  # transformers' config refuses these values: let it say so
    heads = v["num_attention_heads"]
    if arch == "qwen2":
        v["sliding_window"] = v["sliding_window"] if v["use_sliding_window"] else None
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = heads
    if arch != "qwen2" and v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // heads
    if arch == "qwen2" and v["layer_types"] is None:
        v["layer_types"] = ["sliding_attention" if v["sliding_window"] is not None and i >= v["max_window_layers"]
                            else "full_attention" for i in range(v["num_hidden_layers"])]
    rope = _rope_parameters(v, v["layer_types"] if arch == "qwen2" else None)
    if rope is None:
        return None
    types = v.get("layer_types")
    read: dict[str, Any] = {name: v.get(name) for name in _READ}
    return ModelConfig(model_type=arch, rope_parameters=rope, _name_or_path=name, **read,
                       layer_types=None if types is None else [_LEGACY_LAYER_TYPES.get(t, t) for t in types])


def _valid(v: dict[str, Any], arch: str) -> bool:
    """Whether transformers' config class of `arch` takes the values `v` of its own fields (their types: its
    strict dataclass checks them, an int is no float there and a bool no int; llama's heads dividing its
    hidden size), with layer types of the attention the lean runner computes, one a layer."""
    nullable = ("head_dim", "sliding_window", "bos_token_id", "pad_token_id", "layer_types", "eos_token_id",
                *(("num_key_value_heads",) if arch != "mistral" else ()))
    for name in DEFAULTS[arch]:
        value = v[name]
        if name == "eos_token_id" and isinstance(value, list):
            fits = all(_typed(i, int) for i in value)
        else:
            fits = (value is None and name in nullable) or _typed(value, _TYPES.get(name, int))
        if not fits:
            return False
    types = v.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == v["num_hidden_layers"]
                                  and all(t in _LAYER_TYPES for t in types)):
        return False
    return arch != "llama" or v["hidden_size"] % v["num_attention_heads"] == 0


def _typed(value: Any, kind: type) -> bool:
    """isinstance as transformers' strict config checks a field: a bool is no int."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _rope_parameters(v: dict[str, Any], labels: list[str] | None) -> dict[str, Any] | None:
    """rope_parameters as transformers standardises them (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict:
    a legacy rope_scaling first, else rope_parameters, with rope_theta, partial_rotary_factor and rope_type
    filled in where they lack), or None where the lean runner does not compute them (nested per layer type,
    another scaling)."""
    rope = v.get("rope_scaling") or v.get("rope_parameters")
    rope = rope if rope is not None else {}
    if any(key in (labels or ()) for key in rope):
        return None
    rope.setdefault("rope_theta", v.get("rope_theta", DEFAULT_THETA))
    if v.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", v["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope if rope["rope_type"] in COVERED_ROPE else None


def read_config(folder: str | Path) -> ModelConfig | None:
    """The ModelConfig of the config.json saved in `folder` (as AutoConfig.from_pretrained(folder) reads it),
    or None where it is not covered."""
    values = json.loads((Path(folder) / "config.json").read_text())
    return model_config(values, str(folder)) if isinstance(values, dict) else None


# ---------------------------------------------------------------- what runners read of a model


def layer_window(config: Any, attention: Any) -> int | None:
    """The sliding window an attention layer of hf.TREE_ARCHITECTURES passes to the attention function (None:
    full)."""
    if config.model_type in ("qwen2", "qwen3", "gemma3_text"):
        return getattr(attention, "sliding_window", None)  # per layer type
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    return None  # llama


class Attention(NamedTuple):
    """A decoder's attention shape: its query heads, key / value heads and head size."""

    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config: Any) -> Attention:
    """The attention shape of a decoder's config (transformers', or a ModelConfig), as its model derives what
    the config leaves unset: the decoder's own heads where an encoder-decoder config names them apart (BART's
    decoder_attention_heads), else num_attention_heads; num_key_value_heads, else one per query head; head_dim,
    else T5's d_kv, else hidden_size // heads."""
    heads = int(getattr(config, "decoder_attention_heads", None) or config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or config.hidden_size // heads)
    return Attention(heads, kv_heads, head_dim)


def model_max_context(model: Any) -> int:
    """The longest context the model was built for (max_position_embeddings)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "max_position_embeddings", None) or 2**31 - 1)


def model_eos_token_ids(model: Any) -> frozenset[int]:
    """The end-of-sequence ids of the model's generation config (one id or a list; none without one)."""
    return eos_id_set(getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def eos_id_set(eos: Any) -> frozenset[int]:
    """An eos_token_id as configs give it (one id, a list, or none) as a set of ids."""
    if isinstance(eos, int):
        return frozenset({eos})
    return frozenset(int(i) for i in eos) if eos else frozenset()


def model_identity(backend: str, model: Any, dtype: str | None = None) -> dict[str, Any]:
    """What the timings of a runner over a model (transformers', or specdec's module tree) depend on
    (ModelRunner.identity): the runner's class, the model's name ("" for a model built in memory), its dtype
    (int8, or `dtype` where the runner computes another, or the parameters'), device, torch's threads and, for
    int8 weights, the kernels' version (a new kernel times differently)."""
    import torch

    from specdec.native.quant import is_int8

    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return {"backend": backend, "model": "", "threads": torch.get_num_threads()}
    param = next(model.parameters())
    int8 = is_int8(model)
    who: dict[str, Any] = {"backend": backend, "model": str(name),
                           "dtype": dtype or ("int8" if int8 else str(param.dtype)),
                           "device": str(param.device), "threads": torch.get_num_threads()}
    if int8:
        from specdec.native.kernels.build import version

        who["kernel"] = version()
    return who
