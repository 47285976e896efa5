"""A saved int8 model as the lean runner reads it, without transformers' modeling code.

An int4 draft (the default's 0.5B) is a :class:`~specdec.native.lean.LeanRunner` over the int8 model cached
by :func:`specdec.native.quant.save_int8`.  :func:`specdec.native.quant.load_int8` builds transformers'
model for it -- the architecture's modeling module (a second and more to import: it pulls in transformers'
generation, masking and hub-kernel code) and an empty model of the config to load the tensors into -- of
which the lean runner reads only the tensors, the config and a few attributes.  :func:`load` builds just
those: modules named as transformers names them (``model.layers[i].self_attn.q_proj``, ``model.norm``,
``lm_head`` ...) holding the saved tensors, the attention's scaling and sliding window as the architecture
sets them, the rotary tables of :class:`specdec.native.lean.Rotary` (transformers' operations, the same
bits) and the generation config's end-of-sequence ids.  Its config is
:func:`specdec.native.modelconfig.read_config`'s: the values transformers reads, without importing it.
The runner over it computes the same logits, bitwise, as over transformers' model (tested).

Covered: the llama, qwen2 and mistral architectures with SiLU MLPs, default or linear rotary scaling and a
saved (untied) output head; for anything else :func:`load` returns None and the caller loads transformers'
model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from specdec.native.lean import ARCHITECTURES, Rotary
from specdec.native.modelconfig import attention_shape, read_config
from specdec.native.quant import WEIGHTS_FILE, Int8Linear, saved_index


class Part(nn.Module):
    """A named container of submodules and attributes (transformers' module tree, as far as it is read)."""

    def __init__(self, **children: Any) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class Norm(nn.Module):
    """An RMSNorm's weight (the lean runner computes the norm itself)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


def covered(config: Any) -> bool:
    """Whether :func:`load` builds this config's model (else transformers does)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return (config.model_type in ARCHITECTURES and getattr(config, "hidden_act", None) == "silu"
            and rope.get("rope_type", "default") in ("default", "linear"))


def _window(config: Any, layer: int) -> int | None:
    """The sliding window transformers' attention layer `layer` holds (modelconfig.layer_window reads it)."""
    if config.model_type == "qwen2":
        types = getattr(config, "layer_types", None)
        return config.sliding_window if types and types[layer] == "sliding_attention" else None
    return None  # llama: none; mistral: read from the config by modelconfig.layer_window


def _eos(folder: Path, config: Any) -> Any:
    """The generation config's eos_token_id: generation_config.json's where the folder has one (as
    GenerationConfig.from_pretrained reads it), else the model config's (as from_model_config takes it)."""
    try:
        return json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return config.eos_token_id


def load(folder: str | Path) -> nn.Module | None:
    """The int8 model saved in `folder` (quant.save_int8) as the lean runner reads it (see the module doc), or
    None where it is not covered (another architecture, activation or rotary scaling; a tied head)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = saved_index(folder)
    if index is None:
        return None
    config = read_config(folder)  # transformers' values, without transformers
    if config is None or not covered(config):
        return None
    tensors = load_file(str(folder / WEIGHTS_FILE))
    if "lm_head.qweight" not in tensors:
        return None

    def linear(name: str) -> Int8Linear:
        bias = tensors.pop(f"{name}.bias") if index["linears"][name]["bias"] else None
        return Int8Linear(tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scale"), bias)

    head_dim = attention_shape(config).head_dim
    layers = nn.ModuleList()
    for i in range(int(config.num_hidden_layers)):
        at = f"model.layers.{i}."
        attention = Part(**{p: linear(f"{at}self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                         scaling=head_dim ** -0.5, sliding_window=_window(config, i))
        mlp = Part(**{p: linear(f"{at}mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj")}, act_fn=nn.SiLU())
        layers.append(Part(self_attn=attention, mlp=mlp, input_layernorm=Norm(tensors.pop(f"{at}input_layernorm.weight")),
                           post_attention_layernorm=Norm(tensors.pop(f"{at}post_attention_layernorm.weight"))))
    embed = nn.Embedding.from_pretrained(tensors.pop("model.embed_tokens.weight"), freeze=True)
    inner = Part(embed_tokens=embed, layers=layers, norm=Norm(tensors.pop("model.norm.weight")),
                 rotary_emb=Rotary(config, head_dim))
    model = Part(model=inner, lm_head=linear("lm_head"), config=config,
                 generation_config=SimpleNamespace(eos_token_id=_eos(folder, config)))
    if tensors:
        raise ValueError(f"{folder}: unexpected tensors {sorted(tensors)[:3]}")
    model.eval()
    return model
