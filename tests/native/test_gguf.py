"""The gguf target (specdec.native.gguf): a GGUF file's own blocks, every layer in one C call, batch-invariant.

On tiny random GGUF files (tests.tiny_gguf: every block type the kernel takes, llama and qwen2):
- the file is read as gguf's own reader reads it, and its config is transformers' reading of it;
- the network is the file's: its logits equal transformers' model of the file, de-quantised, with the kernel's
  activation quantisation put in front of each linear and llama.cpp's rotary tables (row by row, up to fp32
  rounding); the gguf target's rotary tables are llama.cpp's bit for bit;
- batch invariance: on random forward / rollback sequences, every token's logits (and final hidden states) are
  bitwise those of a runner that evaluates one token at a time, on every path this CPU has and on the C path,
  and the paths give the same bits;
- token trees are bitwise the chains over their paths; packed forwards of several runners bitwise each alone;
- speculative greedy output equals plain greedy output for every γ with a model draft and a constant one;
- a file it cannot run is refused in one line.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from specdec.algorithm.loop import StopCondition, run
from specdec.drafters.model import ModelDrafter
from specdec.errors import SpecdecError
from specdec.native import gguf, kernels
from specdec.native.lean import Rotary, forward_packed
from tests.native.gguf_blocks import Q4_1, Q5_1, block_sums, decode, quantize_activations
from tests.native.test_quant import ConstantDrafter
from tests.tiny_gguf import TYPES, save_tiny_gguf

ARCHS = ["qwen2", "llama"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {arch: save_tiny_gguf(folder / f"tiny-{arch}.gguf", arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(files):
    return {arch: gguf.GGUFModel(gguf.GGUFFile(path)) for arch, path in files.items()}


def runner(models, arch: str, path: str | None = None) -> gguf.GGUFRunner:
    layer_set = gguf.GGUFLayers(models[arch])
    layer_set.use_path(path)
    return gguf.GGUFRunner(models[arch], layer_set=layer_set)


def test_the_parsed_header_is_kept_and_renewed(files, tmp_path, capsys):
    import os
    import shutil

    path = shutil.copy(files["qwen2"], tmp_path / "model.gguf")
    first = gguf.GGUFFile(path)  # parsed, its index written
    index = first._index_path()
    assert index.is_file()
    again = gguf.GGUFFile(path)  # from the index
    assert again.metadata == first.metadata and again.tensors == first.tensors
    assert isinstance(again.metadata["tokenizer.ggml.tokens"], list) and isinstance(again.get("block_count"), int)
    index.write_text(index.read_text().replace('"qwen2"', '"llama"'))  # an index that lies ...
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))  # ... about another version of the file
    assert gguf.GGUFFile(path).architecture == "qwen2"  # parsed again
    index.write_text(index.read_text()[:50])  # truncated
    assert gguf.GGUFFile(path).tensors == first.tensors
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not be read" in err[0] and "parsing the file again" in err[0]
    assert gguf.GGUFFile(path).metadata == first.metadata and capsys.readouterr().err == ""  # written whole again


def test_the_file_is_read_as_ggufs_reader_reads_it(files):
    from gguf import GGUFReader

    for path in files.values():
        ours, theirs = gguf.GGUFFile(path), GGUFReader(path)
        assert set(ours.tensors) == {t.name for t in theirs.tensors}
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.type_id, mine.shape, mine.offset) == (int(t.tensor_type), tuple(int(d) for d in t.shape),
                                                                int(t.data_offset))
            assert np.array_equal(ours.blocks(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))
        assert ours.get("block_count") == 2 and ours.metadata["tokenizer.ggml.eos_token_id"] == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_is_transformers_reading_of_the_file(files, arch):
    from pathlib import Path

    from transformers import AutoConfig

    path = Path(files[arch])
    ours = gguf.config_of(gguf.GGUFFile(path))
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]


KIND = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
        "up_proj": "ffn_up", "down_proj": "ffn_down", "lm_head": "output"}


def file_gelu(g: torch.Tensor) -> torch.Tensor:
    """llama.cpp's tanh-GELU (layers.c's ACT_GELU_FP16, ggml's fp16 table): 0 for g <= -10, g for g >= 10, else the
    fp32 GELU of fp16(g), rounded to fp16."""
    h = g.half().float()
    y = (0.5 * h * (1.0 + torch.tanh(0.7978845608 * h * (1.0 + 0.044715 * h * h)))).half().float()
    return torch.where(g <= -10, torch.zeros_like(g), torch.where(g >= 10, g, y))


def with_block_activations(model: nn.Module, path) -> nn.Module:
    """transformers' model of the GGUF file `path` with each linear's input quantised in blocks as the kernel
    quantises it (the block of its weight's type), the product in float64: the gguf target's network, up to
    rounding.  A Q4_1 / Q5_1 linear's minimums multiply the activation blocks' fp16 sums as the kernel's do (ggml's
    Q8_1 s, gguf_blocks.block_sums), read from the file's blocks; its rotary tables and its tanh-GELU are the file's
    as llama.cpp computes them (gguf.FileRotary, the gguf target's; file_gelu)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    rotary, _ = gguf.GGUFModel(gguf.GGUFFile(str(path))).rotary()
    model.model.rotary_emb.forward = lambda x, position_ids, *kind: rotary(x, position_ids, *kind)
    if getattr(model.config, "hidden_activation", None) == "gelu_pytorch_tanh":  # Gemma's
        for layer in model.model.layers:
            layer.mlp.act_fn.forward = file_gelu
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            kind = KIND[name.split(".")[-1]]
            type_id = TYPES[kind]
            block = kernels.gguf.BLOCK[type_id]
            minimums = None
            if type_id in (Q4_1, Q5_1):  # [n, k / 32]
                t = tensors[f"blk.{name.split('.')[-3]}.{kind}.weight"]
                n, k = module.weight.shape
                minimums = decode(type_id, np.asarray(t.data), n, k)["m"].astype(np.float64)

            def forward(x, module=module, block=block, minimums=minimums):
                rows = x.reshape(-1, x.shape[-1]).detach().numpy()
                q, d = quantize_activations(rows, block)
                dq = (q.reshape(len(rows), -1, block) * d[..., None].astype(np.float64)).reshape(rows.shape)
                y = torch.from_numpy(dq) @ module.weight.double().T
                if minimums is not None:  # m * sx in place of m * dx * X32, block by block
                    x32 = q.reshape(len(rows), -1, block).sum(-1)  # [m, k / 32]
                    shift = block_sums(rows).astype(np.float64) - d.astype(np.float64) * x32
                    y = y + torch.from_numpy(shift @ minimums.T)
                y = y if module.bias is None else y + module.bias.double()
                return y.float().reshape(*x.shape[:-1], -1)

            module.forward = forward
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_the_network_is_the_files(files, models, arch):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(files[arch])
    reference = with_block_activations(AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                            dtype=torch.float32), path)
    ids = list(range(5, 45))
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]  # [n, V]
    got = runner(models, arch).forward(ids)
    # a rounding difference that flips one activation's quant is amplified by the random weights: most rows agree
    # to fp32 rounding, and every row's choice
    error = (got - want).abs().max(-1).values / want.abs().max(-1).values  # [n]
    assert (error < 1e-4).float().mean() >= 0.9, error
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def one_at_a_time(r: gguf.GGUFRunner, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    logits, hidden = [], []
    for t in tokens:
        logits.append(r.forward([t]))
        hidden.append(r.hidden())
    return torch.cat(logits), torch.cat(hidden)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", kernels.gguf.paths())
def test_random_forward_rollback_is_bitwise_one_token_at_a_time(models, arch, path):
    r, mirror = runner(models, arch, path), runner(models, arch, path)
    vocab = r.vocab_size
    rng = random.Random(f"{arch}-{path}")
    base = [rng.randrange(vocab) for _ in range(20)]
    assert torch.equal(r.forward(base), mirror.forward(base))
    sizes = set()
    for _ in range(40):
        if rng.random() < 0.3:
            keep = rng.randrange(1, len(r.tokens) + 1)
            r.rollback(keep)
            mirror.rollback(keep)
            continue
        k = rng.randint(1, 16)
        new = [rng.randrange(vocab) for _ in range(k)]
        logits = r.forward(new)
        hidden = r.hidden()
        want_logits, want_hidden = one_at_a_time(mirror, new)
        assert torch.equal(logits, want_logits), (arch, path, len(r.tokens), k)
        assert torch.equal(hidden, want_hidden)
        sizes.add(k)
        if len(r.tokens) > 300:
            r.rollback(len(base))
            mirror.rollback(len(base))
    assert len(sizes) >= 10 and r.tokens == mirror.tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_every_path_gives_the_same_bits(models, arch):
    ids = list(range(3, 60))
    best = runner(models, arch).forward(ids)
    for path in kernels.gguf.paths():
        assert torch.equal(runner(models, arch, path).forward(ids), best), path


def test_a_tree_is_bitwise_the_chains_over_its_paths(models):
    from specdec.backends.tree import Tree

    prefix = list(range(10, 30))
    tokens, parents = [40, 41, 42, 43, 44, 45], [-1, 0, 0, 1, 3, -1]
    r = runner(models, "qwen2")
    r.forward(prefix)
    logits = r.forward_tree(tokens, parents)
    for node in range(len(tokens)):
        path = Tree(parents, len(tokens)).paths[node]
        chain = runner(models, "qwen2")
        chain.forward(prefix)
        assert torch.equal(logits[node], chain.forward([tokens[i] for i in path])[-1]), node
    r.keep_rows(len(prefix), [0, 1, 3])
    chain = runner(models, "qwen2")
    chain.forward(prefix + [40, 41, 43])
    assert torch.equal(r.forward([7]), chain.forward([7]))


def test_packed_forward_is_bitwise_each_runner_alone(models):
    rng = random.Random(3)
    lead = runner(models, "qwen2")
    batch = [lead, lead.clone(), lead.clone()]  # one layer set
    alone = [runner(models, "qwen2") for _ in range(3)]
    for step in range(12):
        chunks = [[rng.randrange(batch[0].vocab_size) for _ in range(rng.randint(1, 6))] for _ in batch]
        last_ns = [rng.choice([None, 1]) for _ in batch]
        outs = forward_packed(batch, chunks, last_ns)
        for out, a, chunk, last_n in zip(outs, alone, chunks, last_ns):
            assert torch.equal(out, a.forward(chunk, last_n=last_n)), step


def test_tapped_layers_are_the_residual_stream(models):
    r = runner(models, "llama")
    r.tap_layers([0, 1])
    r.forward(list(range(5, 15)))
    rows = r.hidden()  # [n, hidden x 3]
    hidden = models["llama"].hidden
    assert rows.shape == (10, 3 * hidden)
    plain = runner(models, "llama")
    plain.forward(list(range(5, 15)))
    assert torch.equal(rows[:, :hidden], plain.hidden())  # the final hidden states first, unchanged
    assert not torch.equal(rows[:, hidden : 2 * hidden], rows[:, 2 * hidden :])


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_equals_plain(models, arch):
    draft_model = gguf.GGUFModel(gguf.GGUFFile(save_tiny_gguf_cached(arch)))
    rng = random.Random(arch)
    for prompt_len in (1, 17):
        prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]
        plain = run(runner(models, arch), prompt, StopCondition(24))
        for gamma in (1, 2, 3, 5, 8):
            for drafter in (ModelDrafter(gguf.GGUFRunner(draft_model)), ConstantDrafter()):
                spec = run(runner(models, arch), prompt, StopCondition(24), drafter=drafter,
                           num_speculative_tokens=gamma)
                assert spec.token_ids == plain.token_ids, (prompt_len, gamma, type(drafter).__name__)
                assert spec.stats.drafted > 0


_DRAFTS: dict[str, str] = {}


def save_tiny_gguf_cached(arch: str) -> str:
    """A second tiny model of the architecture (another seed): an unrelated draft."""
    import tempfile

    if arch not in _DRAFTS:
        _DRAFTS[arch] = save_tiny_gguf(f"{tempfile.mkdtemp()}/draft-{arch}.gguf", arch, seed=11)
    return _DRAFTS[arch]


def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, files):
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "iq2xxs.gguf"
    source = gguf.GGUFFile(files["qwen2"])
    writer = GGUFWriter(str(path), "qwen2")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length"):
        writer.add_uint32(f"qwen2.{key}", int(source.get(key)))
    writer.add_tensor("token_embd.weight", np.zeros((4, 66), np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecdecError, match="token_embd.weight is IQ2_XXS, which the gguf target does not multiply") as e:
        gguf.GGUFModel(gguf.GGUFFile(path))
    assert "\n" not in str(e.value)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(SpecdecError, match="cannot read GGUF file"):
        gguf.GGUFFile(tmp_path / "bad.gguf")


def test_the_engine_runs_a_gguf_file_exactly(files, tmp_path, monkeypatch):
    from specdec.runtime.engine import Engine
    from specdec.runtime.runners import fastest_dtype

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    target = files["qwen2"]
    simd = ("avx512-vnni", "avx2")  # auto: the GGUF's blocks where that kernel runs SIMD, else int8 where it does
    assert fastest_dtype(target) == ("gguf" if kernels.gguf.isa() in simd else "int8" if kernels.int8.isa() in simd
                                     else "fp32")
    engine = Engine.load(target, "lookup", dtype="gguf")
    assert engine.dtype == "gguf" and engine.target_runner.describe() == "specdec gguf"
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    plain = engine.generate(prompt, max_new_tokens=30, use_draft=False)
    for k in (2, 5, "auto"):
        assert engine.generate(prompt, max_new_tokens=30, num_speculative_tokens=k).token_ids == plain.token_ids, k
    drafted = Engine.load(target, save_tiny_gguf_cached("qwen2"), dtype="gguf", draft_dtype="gguf")
    spec = drafted.generate(prompt, max_new_tokens=30, num_speculative_tokens=3)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_gguf_is_refused_for_what_is_not_a_gguf_file(tmp_path):
    from specdec.runtime.engine import Engine
    from tests.tiny import save_tiny

    folder = save_tiny(tmp_path / "tiny")
    with pytest.raises(SpecdecError, match="--dtype gguf runs a GGUF model"):
        Engine.load(folder, None, dtype="gguf")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 1e6},
                                  {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}])
def test_the_rotary_tables_are_transformers_bits(arch, rope):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=512, num_hidden_layers=1, vocab_size=300, rope_parameters=rope)
    with torch.device("meta"):
        kind = type(AutoModelForCausalLM.from_config(config).model.rotary_emb)
    module = kind(config)  # on the CPU, as the runner built it before
    positions = torch.arange(0, 40000, 7)[None]  # [1, n]
    ours, theirs = Rotary(config, 64)(torch.zeros(1), positions), module(torch.zeros(1), positions)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("rope, factors", [({"rope_theta": 1e6}, None),
                                           ({"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0}, None),
                                           ({"rope_theta": 5e5}, np.geomspace(1.0, 32.0, 48))])
def test_the_gguf_targets_rotary_tables_are_llama_cpps(rope, factors):
    """gguf.FileRotary: llama.cpp's rope cache, the angles iterated in fp32 from the position (theta *= powf(base,
    -2 / d)), divided by Llama 3's factors, times 1 / factor for linear scaling, and libm's cosf / sinf of them --
    bit for bit (here from libm through ctypes); not transformers' tables (lean.Rotary), which differ in places."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for name in ("powf", "cosf", "sinf"):
        getattr(libm, name).restype = ctypes.c_float
    libm.powf.argtypes, libm.cosf.argtypes, libm.sinf.argtypes = [ctypes.c_float] * 2, [ctypes.c_float], [ctypes.c_float]
    d, positions = 96, torch.arange(0, 9000, 37)  # [n]
    f32 = np.float32
    step = f32(libm.powf(rope["rope_theta"], float(f32(-2.0) / f32(d))))
    scale = f32(1.0) / f32(rope["factor"]) if rope.get("rope_type") == "linear" else f32(1.0)
    want_cos, want_sin = np.zeros((len(positions), d), f32), np.zeros((len(positions), d), f32)
    for i, p in enumerate(positions.tolist()):
        theta = f32(p)
        for j in range(d // 2):
            angle = scale * (theta / f32(factors[j]) if factors is not None else theta)
            want_cos[i, [j, j + d // 2]] = libm.cosf(float(angle))
            want_sin[i, [j, j + d // 2]] = libm.sinf(float(angle))
            theta = theta * step
    table = gguf.FileRotary(rope, d, None if factors is None else torch.from_numpy(factors.astype(f32)))
    cos, sin = table(torch.zeros(1), positions[None])  # [1, n, d]
    assert np.array_equal(cos[0].numpy(), want_cos) and np.array_equal(sin[0].numpy(), want_sin)
    theirs = Rotary({"rope_type": "default", **rope}, d, None if factors is None else torch.from_numpy(factors))
    assert not torch.equal(theirs(torch.zeros(1), positions[None])[0], cos)


# A warm start with the defaults' kinds of models -- a gguf target, an int4 draft from its saved int8 model, both
# tokenizers from their snapshots (specdec.tokenizer) -- imports no transformers module at all (its import alone
# takes half a second).  The first start takes the tokenizers' snapshots through transformers.
_TRANSFORMERS_IMPORTED = """
import json, sys

from specdec.runtime.engine import Engine
engine = Engine.load(sys.argv[1], sys.argv[2], dtype="gguf", draft_dtype="int4")
engine.generate("def f(x):", max_new_tokens=3)
print(json.dumps({"transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                  "runners": [type(engine.target_runner).__name__, engine.draft_runner.describe()]}))
"""


def test_a_gguf_target_and_an_int4_draft_import_no_transformers(files, tmp_path):
    import json
    import subprocess
    import sys

    from specdec.runtime.loading import load_hf
    from tests.tiny import save_tiny

    draft = save_tiny(tmp_path / "draft", "qwen2")
    load_hf(draft, dtype="int8")  # its int8 model cached, as the default draft's is after its first use
    seen = []
    for _ in range(2):  # the first start takes the tokenizers' snapshots, the second is a warm one
        out = subprocess.run([sys.executable, "-c", _TRANSFORMERS_IMPORTED, files["qwen2"], draft],
                             capture_output=True, text=True, check=True)
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert seen[1]["runners"][0] == "GGUFRunner" and seen[1]["runners"][1].startswith("specdec int4")
    assert "transformers.tokenization_utils_base" in seen[0]["transformers"]  # the snapshots' first start
    assert seen[1]["transformers"] == []


def test_the_runner_needs_no_transformers_model(files):
    import subprocess
    import sys

    from specdec.backends.hf import model_eos_token_ids

    code = ("import sys; from specdec.runtime.engine import Engine; "
            "Engine.load(sys.argv[1], None, dtype='gguf').generate('def f(x):', max_new_tokens=3); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.llama.modeling',"
            "'transformers.models.qwen2.modeling', 'transformers.generation.utils'))))")
    out = subprocess.run([sys.executable, "-c", code, files["llama"]], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # the model's modeling code (a second to import) is not needed to run it
    r = gguf.load(files["qwen2"])
    assert r.eos_token_ids == model_eos_token_ids(r.model) and r.eos_token_ids  # the generation config's
