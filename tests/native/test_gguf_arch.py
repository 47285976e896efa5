"""The gguf target's architectures (specdec.native.gguf's ARCHS): what it runs of a file, and that it runs it right.

- accounting: a file with a tensor, a metadata key or a key's value that its architecture's mapping does not
  account for is refused in one line naming it, before anything runs; the CLI exits 2 and generates nothing;
  norms, biases and linears of other shapes than the config's are refused too;
- gemma3, gemma2, qwen3 and phi3 on small random files (tests.native.gguf_files.save_arch_gguf: gemma3's q / k
  norms, output norms, scaled embedding, tanh-GELU gate, five sliding-window layers of six with their own rotary
  base, a head wider than hidden / heads; qwen3's per-head q / k norms; phi3's fused attn_qkv and gate-and-up
  ffn_up): transformers' model of the file with the kernel's block activations in front of each linear, up to
  fp32 rounding; llama.cpp's logits of the same file (and of tests.tiny_gguf's llama, qwen2 and mistral files,
  mistral's against its llama twin) on 200 positions: the same argmax on >= 99% of them and an rms distance of at
  most 2% of llama.cpp's rms logit (tests.native.gguf_files: measured 99.5-100% and <= 1%, what is left fp32
  roundings in other orders, amplified by the random weights where one flips a quantised activation; skipped
  without llama-cpp-python; phi3's file without its vocabulary, which llama.cpp's phi3 loader refuses; llama.cpp
  applies no sliding window to phi3, as the gguf target); batch-invariant bitwise (a forward of any chunks is one
  token at a time) on every path this CPU has, the paths giving the same bits; speculative greedy output equal
  to plain; qwen3's chain in one native call (draft_greedy) its greedy steps;
- mistral's sliding window is applied: transformers' Mistral model of the file with block activations;
- gemma2 (gemma3's layers without q / k norms, one rotary table, a window on every other layer): its attention
  scores and logits soft-capped as the file says; the attention kernel's capped scores are the capped softmax,
  the same bits on every path (the uncapped path unchanged: tests/native/test_attention_kernel.py).
"""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.native import gguf, kernels
from tests.native.gguf_files import assert_close_to_llama_cpp, edited_copy, llama_cpp_logits, save_arch_gguf
from tests.tiny_gguf import save_tiny_gguf

SYNTHETIC = ["gemma3", "gemma2", "qwen3", "phi3"]  # small random files of the architectures without a zoo model of their own


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arch")
    return {arch: save_tiny_gguf(folder / f"{arch}.gguf", arch) for arch in ("llama", "qwen2")}


REFUSED = [  # (architecture, keys set, tensors added, what the message names)
    ("qwen2", {}, {"rope_freqs.weight": np.ones(32)}, "rope_freqs.weight"),
    ("qwen2", {}, {"blk.1.attn_output.bias": np.zeros(256)}, "blk.1.attn_output.bias"),
    ("llama", {}, {"blk.0.attn_q.bias": np.zeros(256)}, "blk.0.attn_q.bias"),
    ("llama", {}, {"blk.0.post_attention_norm.weight": np.ones(256)}, "blk.0.post_attention_norm.weight"),
    ("llama", {}, {"blk.2.attn_norm.weight": np.ones(256)}, "blk.2.attn_norm.weight"),  # a layer past block_count
    ("llama", {}, {"blk.1.ffn_norm.weight": np.ones(255)}, "blk.1.ffn_norm.weight has 255 values"),
    ("qwen2", {}, {"blk.0.attn_k.bias": np.ones(64)}, "blk.0.attn_k.bias has 64 values"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, {}, "'yarn' rotary scaling"),
    ("qwen2", {"qwen2.attn_logit_softcapping": 50.0}, {}, "qwen2.attn_logit_softcapping"),
    ("llama", {"llama.final_logit_softcapping": 30.0}, {}, "llama.final_logit_softcapping"),
    ("llama", {"llama.attention.sliding_window": 128}, {}, "llama.attention.sliding_window"),
    ("llama", {"llama.attention.sliding_window_pattern": 4}, {}, "llama.attention.sliding_window_pattern"),
    ("llama", {"llama.rope.dimension_count": 32}, {}, "partial rotary"),
    ("qwen2", {"qwen2.attention.scale": 0.1}, {}, "qwen2.attention.scale"),
    ("llama", {"llama.expert_count": 8}, {}, "mixture-of-experts"),
    ("llama", {"general.type": "adapter"}, {}, "is a 'adapter', not a model"),
    ("llama", {"clip.vision.block_count": 2}, {}, "clip.vision.block_count"),
]


@pytest.mark.parametrize("arch, keys, tensors, named", REFUSED)
def test_what_a_file_holds_beyond_its_architecture_is_refused_in_one_line(tiny, tmp_path, arch, keys, tensors, named):
    path = edited_copy(tiny[arch], tmp_path / "edited.gguf", keys=keys, tensors=tensors)
    with pytest.raises(SpecdecError) as e:
        gguf.GGUFModel(gguf.GGUFFile(path))
    message = str(e.value)
    assert named in message and "\n" not in message, message


def test_what_changes_nothing_passes(tiny, tmp_path):
    keys = {"general.author": "someone", "general.type": "model", "tokenizer.chat_template": "{{ x }}",
            "quantize.imatrix.file": "x.dat", "llama.rope.scaling.type": "none", "llama.rope.dimension_count": 64,
            "llama.attention.value_length": 64, "llama.vocab_size": 300, "llama.expert_count": 0}
    path = edited_copy(tiny["llama"], tmp_path / "harmless.gguf", keys=keys)
    assert gguf.GGUFModel(gguf.GGUFFile(path)).config.num_hidden_layers == 2


def test_the_cli_exits_2_in_one_line_and_generates_nothing(tiny, tmp_path):
    path = edited_copy(tiny["llama"], tmp_path / "extra.gguf", tensors={"blk.0.ffn_norm.bias": np.zeros(256)})
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "def f(x):", "--target", path,
                          "--dtype", "gguf", "--draft", "none", "--max-new-tokens", "4", "--json"],
                         capture_output=True, text=True, env={**__import__("os").environ,
                                                                "SPECDEC_HOME": str(tmp_path / "home")})
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "blk.0.ffn_norm.bias" in lines[0], out.stderr


# ---------------------------------------------------------------- the architectures beyond llama / qwen2 / mistral


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    return {arch: save_arch_gguf(folder / f"{arch}.gguf", arch) for arch in SYNTHETIC}


@pytest.fixture(scope="module")
def synthetic_models(synthetic):
    return {arch: gguf.GGUFModel(gguf.GGUFFile(path)) for arch, path in synthetic.items()}


def synthetic_runner(models, arch: str, path: str | None = None) -> gguf.GGUFRunner:
    r = gguf.GGUFRunner(models[arch])
    r.layer_set.use_path(path)  # (shared by the model's runners: every test sets its own)
    return r


@pytest.mark.parametrize("arch", SYNTHETIC)
def test_the_config_is_transformers_config_of_its_values(synthetic, arch):
    from tests.native.test_modelconfig import assert_same

    file = gguf.GGUFFile(synthetic[arch])
    assert_same(gguf.config_of(file, "name"), lambda: gguf.transformers_config_of(file, "name"))


def llama_cpp_loads(path: str, arch: str, folder) -> str:
    """The file as llama.cpp loads it: phi3's without its vocabulary (llama.cpp's phi3 loader refuses the tiny
    tokenizer, "error loading model vocabulary"; the logits of token ids need none), the others as they are."""
    if arch != "phi3":
        return path
    vocab = gguf.GGUFFile(path).tensors["token_embd.weight"].rows
    return edited_copy(path, folder / "no-vocabulary.gguf", keys={"tokenizer.ggml.model": "none", "phi3.vocab_size": vocab},
                       drop=("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                             "tokenizer.ggml.pre"))


@pytest.mark.parametrize("arch", [*SYNTHETIC, "llama", "qwen2", "mistral"])
def test_the_synthetic_models_are_llama_cpps(synthetic, synthetic_models, tiny, arch, tmp_path):
    # 200 positions: argmax llama.cpp's on >= 99% of them, rms distance <= 2% (tests.native.gguf_files)
    tokens = random.Random(arch).choices(range(3, 250), k=200)  # gemma: 25 times its window of 8
    if arch in SYNTHETIC:
        ours = synthetic_runner(synthetic_models, arch).forward(tokens).numpy()
        theirs = llama_cpp_logits(llama_cpp_loads(synthetic[arch], arch, tmp_path), tokens)
    else:  # llama.cpp reads no "mistral" file: the llama file of the same seed is its model without a window
        path = tiny[arch] if arch != "mistral" else save_tiny_gguf(tmp_path / "mistral.gguf", "mistral")
        ours = gguf.load(path).forward(tokens).numpy()
        theirs = llama_cpp_logits(tiny["llama" if arch == "mistral" else arch], tokens)
    assert_close_to_llama_cpp(ours, theirs)
    if arch == "phi3":  # llama.cpp applies no sliding window to phi3: without the key, the same logits
        unwindowed = edited_copy(llama_cpp_loads(synthetic[arch], arch, tmp_path), tmp_path / "unwindowed.gguf",
                                 drop=("phi3.attention.sliding_window",))
        assert np.array_equal(llama_cpp_logits(unwindowed, tokens), theirs)


@pytest.mark.parametrize("arch", SYNTHETIC)
def test_the_synthetic_models_are_transformers_with_block_activations(synthetic, synthetic_models, arch):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from tests.native.gguf_files import CAPS, HEAD_DIM
    from tests.native.test_gguf import KIND, with_block_activations

    KIND.update(qkv_proj="attn_q", gate_up_proj="ffn_up")  # phi3's fused linears: the types they are written in

    path = Path(synthetic[arch])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if arch.startswith("gemma"):  # llama.cpp's reading of the file: query_pre_attn_scalar the head's size
        for layer in model.model.layers:  # (transformers' GGUF loader leaves it at its default, 256) ...
            layer.self_attn.scaling = HEAD_DIM**-0.5
    if arch == "gemma2":  # ... and the file's soft-capping (transformers' loader keeps its defaults, 30 and 50)
        model.config.final_logit_softcapping = CAPS["final_logit_softcapping"]
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = CAPS["attn_logit_softcapping"]
    if arch == "phi3":  # llama.cpp applies no sliding window to Phi-3 (nor does transformers' model of the file)
        assert model.config.sliding_window is None and gguf.config_of(gguf.GGUFFile(path)).sliding_window is None
    tokens = random.Random(arch).choices(range(3, 250), k=40)
    with torch.no_grad():
        want = with_block_activations(model, path)(torch.tensor([tokens])).logits[0]  # [n, V]
    got = synthetic_runner(synthetic_models, arch).forward(tokens)
    # as in test_gguf: a rounding difference that flips one activation's quant is amplified by the random weights,
    # and attention carries it to every later position: the first such flip is chance (qwen3: at position 19,
    # gemma3 at 9, where llama.cpp's logits part from both as well; phi3 none), but the nine positions before it
    # -- a rotary table, a window of 8, a norm or a scale computed wrong shows there -- are the model's to fp32
    # rounding, and the rest within a flip's reach
    error = (got - want).abs().max(-1).values / want.abs().max(-1).values  # [n]
    assert (error[:9] < 1e-4).all() and (error < 1e-4).float().mean() >= 0.3, error
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", SYNTHETIC)
def test_the_architectures_are_batch_invariant_on_every_path(synthetic_models, arch):
    rng = random.Random(arch)
    tokens = [rng.randrange(3, 250) for _ in range(30)]
    want = None
    for path in kernels.gguf.paths():
        r, alone = synthetic_runner(synthetic_models, arch, path), synthetic_runner(synthetic_models, arch, path)
        chunks, at = [], 0
        while at < len(tokens):
            k = rng.randint(1, 9)
            chunks.append(r.forward(tokens[at : at + k]))
            at += k
        got = torch.cat(chunks)
        one = torch.cat([alone.forward([t]) for t in tokens])
        assert torch.equal(got, one), path
        want = got if want is None else want
        assert torch.equal(got, want), path  # every path the same bits


@pytest.mark.parametrize("arch", SYNTHETIC)
def test_speculative_equals_plain_for_the_architectures(synthetic_models, arch):
    from specdec.algorithm.loop import StopCondition, run
    from tests.native.test_quant import ConstantDrafter

    rng = random.Random(arch)
    prompt = [rng.randrange(3, 250) for _ in range(12)]
    plain = run(synthetic_runner(synthetic_models, arch), prompt, StopCondition(24))
    for gamma in (2, 5):
        spec = run(synthetic_runner(synthetic_models, arch), prompt, StopCondition(24), drafter=ConstantDrafter(),
                   num_speculative_tokens=gamma)
        assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0, gamma


def test_a_qwen3_chain_in_one_call_is_its_greedy_steps(synthetic_models):
    chain, steps = synthetic_runner(synthetic_models, "qwen3"), synthetic_runner(synthetic_models, "qwen3")
    feed = list(range(5, 25))
    row, want = steps.forward(feed, last_n=1), []
    for _ in range(6):
        want.append(int(row[-1].argmax()))
        row = steps.forward(want[-1:])
    assert chain.draft_greedy(feed, 6) == want
    # gemma's chain would need its scaled embedding (gemma3: its second rotary table; gemma2: capped logits): it
    # drafts token by token
    assert not any(synthetic_runner(synthetic_models, arch).capabilities.draft_chain for arch in ("gemma3", "gemma2"))


def test_mistrals_sliding_window_is_applied(tmp_path):
    # transformers reads no "mistral" GGUF file: its model is built from the file's config with the weights of the
    # same random llama file (the same seed writes the same tensors; mistral's q / k rows are permuted as llama's)
    from pathlib import Path

    from transformers import AutoModelForCausalLM, MistralForCausalLM

    from tests.native.test_gguf import with_block_activations

    llama = Path(save_tiny_gguf(tmp_path / "llama.gguf", "llama"))
    plain = save_tiny_gguf(tmp_path / "mistral.gguf", "mistral")
    windowed = edited_copy(plain, tmp_path / "windowed.gguf", keys={"mistral.attention.sliding_window": 8})
    tokens = random.Random(0).choices(range(3, 250), k=30)
    got, unwindowed = gguf.load(windowed).forward(tokens), gguf.load(plain).forward(tokens)
    assert all(torch.equal(got[i], unwindowed[i]) for i in range(8))  # the window holds all they see
    assert not any(torch.equal(got[i], unwindowed[i]) for i in range(9, 30))
    model = MistralForCausalLM(gguf.transformers_config_of(gguf.GGUFFile(windowed)))
    assert model.config.sliding_window == 8
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(llama.parent, gguf_file=llama.name,
                                                               dtype=torch.float32).state_dict())
    with torch.no_grad():
        want = with_block_activations(model, llama)(torch.tensor([tokens])).logits[0]  # [n, V]
    error = (got - want).abs().max(-1).values / want.abs().max(-1).values  # a flip's reach: 23 of 30 within
    assert (error < 1e-4).float().mean() >= 0.7 and torch.equal(got.argmax(-1), want.argmax(-1)), error


@pytest.mark.parametrize("keys, tensors, named", [
    ({}, {"rope_factors_long.weight": np.ones(32), "rope_factors_short.weight": np.ones(32)}, "rope_factors_long"),
    ({"phi3.rope.scaling.attn_factor": 1.19}, {}, "phi3.rope.scaling.attn_factor"),  # LongRoPE's
    ({"phi3.rope.dimension_count": 48}, {}, "partial rotary"),  # Phi-4-mini's
])
def test_phi3s_longrope_and_partial_rotary_variants_are_refused(synthetic, tmp_path, keys, tensors, named):
    path = edited_copy(synthetic["phi3"], tmp_path / "variant.gguf", keys=keys, tensors=tensors)
    with pytest.raises(SpecdecError, match=named) as e:
        gguf.GGUFModel(gguf.GGUFFile(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("window", [None, 5])
def test_capped_attention_is_the_capped_softmax_on_every_path(window):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, n, start, d, cap = 4, 2, 7, 9, 64, 5.0
    q = 3 * torch.randn(heads, n, d, generator=gen)  # scores of many times the cap: it bites
    keys, values = torch.randn(2, kv_heads, start + n, d, generator=gen)
    scale = d**-0.5
    outs = [kernels.attention.causal(q, keys, values, start, scale, window, path=path, softcap=cap)
            for path in kernels.attention.paths()]
    assert all(torch.equal(out, outs[0]) for out in outs)  # the same bits on every path
    want = []
    for i in range(n):
        end = start + i + 1
        lo = max(0, end - window) if window else 0
        k = keys.repeat_interleave(heads // kv_heads, 0)[:, lo:end]  # [H, L, D]
        v = values.repeat_interleave(heads // kv_heads, 0)[:, lo:end]
        scores = cap * torch.tanh((q[:, i : i + 1] @ k.transpose(1, 2)) * scale / cap)  # [H, 1, L]
        want.append((torch.softmax(scores.double(), -1).float() @ v).reshape(-1))  # [H D]
    torch.testing.assert_close(outs[0], torch.stack(want), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[0], kernels.attention.causal(q, keys, values, start, scale, window), atol=1e-3)


def test_gemma3s_window_pattern_is_the_files_where_it_says(synthetic, tmp_path):
    default = gguf.config_of(gguf.GGUFFile(synthetic["gemma3"]))
    assert default.layer_types == ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's: one layer of six
    path = edited_copy(synthetic["gemma3"], tmp_path / "pattern.gguf", keys={"gemma3.attention.sliding_window_pattern": 3})
    model = gguf.GGUFModel(gguf.GGUFFile(path))
    assert model.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert [layer.sliding_window for layer in model.layers] == [8, 8, None, 8, 8, None]
    assert [layer.rope for layer in model.layers] == [1, 1, 0, 1, 1, 0]  # full_attention's table first (sorted)
