"""A model's config without transformers (specdec.native.modelconfig): every attribute the lean runner, the gguf
target and the saved int8 draft read has the value, and the type, of transformers' config of the same values.

Compared on tiny configs of the llama, qwen2 and mistral architectures (every default missing, legacy
rope_theta / rope_scaling keys, linear scaling, explicit nulls, qwen2's sliding windows) built both ways
(AutoConfig.for_model, and a saved config.json read by AutoConfig.from_pretrained), on the zoo's converted and
int8 folders and GGUF files where this machine has them, and on what it leaves to transformers (None).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from specdec.native import gguf
from specdec.native.modelconfig import DEFAULTS, ModelConfig, attention_shape, model_config, read_config
from tests.conftest import USER_HOME

ATTRIBUTES = [f.name for f in fields(ModelConfig)]
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
CASES: list[dict[str, Any]] = [
    {},  # every default: the class's own
    TINY,
    {**TINY, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "eos_token_id": [2, 7],
     "bos_token_id": None, "tie_word_embeddings": True, "pad_token_id": 0},
    {**TINY, "num_key_value_heads": None, "head_dim": 32},  # explicit null: the attention heads'; a head size given
    {**TINY, "rope_theta": 500000},  # legacy: an int theta, no rope dict
    {**TINY, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}},  # legacy linear scaling
    {**TINY, "rope_scaling": {"rope_type": "linear", "factor": 4}},  # theta defaulted, an int factor
    {**TINY, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}},
    {**TINY, "rope_parameters": {"rope_theta": 2e5}, "rope_theta": 3.0},  # the dict's theta wins, type defaulted
    {**TINY, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    {**TINY, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},  # qwen2: layers 1.. slide
    {**TINY, "use_sliding_window": False, "sliding_window": 16},  # qwen2: no window after all
    {**TINY, "sliding_window": None},  # mistral: full attention
    {**TINY, "layer_types": ["full_attention", "attention", "full_attention"]},  # legacy names renamed
    {**TINY, "hidden_act": "gelu", "partial_rotary_factor": 0.5},
    # what transformers refuses (its strict types; llama's heads dividing its hidden size; layer types one a layer)
    {**TINY, "rms_norm_eps": 0},
    {**TINY, "num_hidden_layers": 3.0},
    {**TINY, "tie_word_embeddings": 1},
    {**TINY, "eos_token_id": [2, "7"]},
    {**TINY, "num_attention_heads": 5},
    {**TINY, "layer_types": ["full_attention"]},
]


def assert_same(ours: ModelConfig | None, build: Callable[[], Any]) -> None:
    """Every attribute of ours equals that of transformers' config (missing there: None here), and is of the
    same type; ours is None where transformers refuses the values."""
    try:
        theirs = build()
    except Exception:  # noqa: BLE001  # its strict types' error, a ValueError...
        assert ours is None
        return
    assert ours is not None
    for name in ATTRIBUTES:
        mine, want = getattr(ours, name), getattr(theirs, name, None)
        assert mine == want, name
        assert type(mine) is type(want), name  # an int theta stays an int, a float eps a float
        if isinstance(want, dict):
            assert {k: type(v) for k, v in mine.items()} == {k: type(v) for k, v in want.items()}, name


@pytest.mark.parametrize("arch", sorted(DEFAULTS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_config_is_transformers_config(tmp_path, arch, case):
    from transformers import AutoConfig

    values = json.loads(json.dumps(CASES[case]))  # transformers changes its arguments in place
    if arch == "mistral" and "layer_types" in values:  # AutoConfig.from_pretrained reads a ministral config
        assert model_config({**values, "model_type": arch}) is None
        return
    assert_same(model_config({**values, "model_type": arch}, "x"),
                lambda: AutoConfig.for_model(arch, name_or_path="x", **json.loads(json.dumps(values))))
    (tmp_path / "config.json").write_text(json.dumps({**values, "model_type": arch}))
    assert_same(read_config(tmp_path), lambda: AutoConfig.from_pretrained(tmp_path))


@pytest.mark.parametrize("values", [
    {"model_type": "gemma3_text"},  # another architecture
    {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},  # a scaling lean lacks
    {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    {"model_type": "qwen2", "num_hidden_layers": 1, "layer_types": ["full_attention"],
     "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},  # per layer type
])
def test_what_it_does_not_cover_is_left_to_transformers(values):
    assert model_config(values) is None


@pytest.mark.parametrize("arch, values, where", [
    ("llama", TINY, "layers.0.self_attn"),  # kv heads and head size derived
    ("llama", {**TINY, "num_key_value_heads": 2, "head_dim": 32}, "layers.0.self_attn"),
    ("qwen2", {**TINY, "num_key_value_heads": 1}, "layers.0.self_attn"),
    ("mistral", {**TINY, "head_dim": 8}, "layers.0.self_attn"),
    # an encoder-decoder's decoder: BART's heads named apart from the encoder's, T5's head size d_kv
    ("bart", dict(vocab_size=300, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=8,
                  decoder_attention_heads=4), "decoder.layers.0.self_attn"),
    ("t5", dict(vocab_size=300, d_model=64, d_kv=8, num_heads=4, num_layers=1, d_ff=128),
     "decoder.block.0.layer.0.SelfAttention"),
])
def test_attention_shape_is_the_models(arch, values, where):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(arch, **values)
    attention = AutoModel.from_config(config).get_submodule(where)  # the decoder's first self-attention
    q, k = (getattr(attention, f"{name}_proj", None) or getattr(attention, name) for name in "qk")
    head_dim = getattr(attention, "head_dim", None) or attention.key_value_proj_dim
    assert attention_shape(config) == (q.out_features // head_dim, k.out_features // head_dim, head_dim)
    covered = model_config({**values, "model_type": arch})
    if covered is not None:  # specdec's own config of the same values: the same shape
        assert attention_shape(covered) == attention_shape(config)


def zoo_folders() -> list[Path]:
    return sorted(p.parent for kind in ("hf", "int8") for p in (USER_HOME / kind).glob("*/config.json"))


@pytest.mark.parametrize("folder", zoo_folders(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_zoos_saved_configs(folder):
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(folder)
    if theirs.model_type not in DEFAULTS:  # gemma3_text: transformers' config, as before
        assert read_config(folder) is None
        return
    assert_same(read_config(folder), lambda: theirs)


@pytest.mark.parametrize("path", sorted((USER_HOME / "models").glob("*.gguf")), ids=lambda p: p.name)
def test_the_zoos_gguf_files(path):
    file = gguf.GGUFFile(path)
    if file.architecture not in gguf.ARCHITECTURES:
        pytest.skip(f"the gguf target does not run {file.architecture}")
    assert_same(gguf.config_of(file, "name"), lambda: gguf.transformers_config_of(file, "name"))
