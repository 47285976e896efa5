"""The llama.cpp backend.

Unit tests (no llama.cpp needed): LlamaCppRunner's bookkeeping over a fake
session that stands in for the C API.  The fake "model" gives, at each
position, logits that are a fixed function of the whole prefix up to it, and
keeps a cache that must only ever be appended to at its end (decode at
position == cache length) and truncated by remove().  So any mistake in
positions, rollback, chunking or output selection shows up as different
logits from a fresh runner fed the same tokens.

Real-model tests (marked `real`; skipped where llama-cpp-python is not
installed, except in CI, which installs it with scripts/install-llamacpp.sh and
fails without it or with a build that is not batch-invariant): llama.cpp and
transformers tokenize alike; the runner contract, bitwise; speculative greedy
== plain greedy on llama.cpp (same tokenizer and universal); a torch target
with llama.cpp drafts; the CLI with --backend llamacpp.
"""

from __future__ import annotations

import json
import random
import zlib

import numpy as np
import pytest
import torch

from specdec.backends.base import ModelRunner
from specdec.backends.llamacpp import LlamaCppRunner, batch_invariant_build, build_features, print_llama_log
from specdec.errors import SpecdecError
from tests.conftest import in_ci, require_llama_cpp

VOCAB = 50


def prefix_logits(prefix: list[int]) -> np.ndarray:
    seed = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
    return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32)


class FakeSession:
    def __init__(self, n_ctx: int = 64, n_batch: int = 8) -> None:
        self.n_vocab, self.n_ctx, self.n_batch = VOCAB, n_ctx, n_batch
        self.path, self.exact, self.n_threads = "", False, None
        self.cache: list[int] = []
        self.calls: list[tuple[int, int, int]] = []  # (start, tokens, outputs)
        self.fail_at: int | None = None  # position whose decode raises

    def decode(self, tokens, start, outputs):
        assert 0 < len(tokens) <= self.n_batch and 0 <= outputs <= len(tokens)
        assert start == len(self.cache), "decode must continue the cache at its end"
        if self.fail_at is not None and start <= self.fail_at < start + len(tokens):
            raise SpecdecError("decode failed")
        self.calls.append((start, len(tokens), outputs))
        self.cache.extend(tokens)
        rows = [prefix_logits(self.cache[: start + i + 1]) for i in range(len(tokens) - outputs, len(tokens))]
        return np.stack(rows) if rows else np.empty((0, VOCAB), np.float32)

    def remove(self, start):
        del self.cache[start:]

    def close(self):
        pass


def fresh_logits(tokens: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.stack([prefix_logits(tokens[: i + 1]) for i in range(len(tokens))]))


def test_llama_cpp_logs_only_its_errors(capsys):
    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous message.
    for level, text in [(2, b"info "), (3, b"load: control-looking token ... "), (5, b"warn tail "),
                        (4, b"error "), (5, b"error tail\n"), (1, b"debug ")]:
        print_llama_log(level, text)
    assert capsys.readouterr().err == "error error tail\n"


def test_is_a_model_runner():
    runner = LlamaCppRunner(FakeSession())
    assert isinstance(runner, ModelRunner)
    assert runner.vocab_size == VOCAB and runner.max_context == 64


@pytest.mark.parametrize("mode", ["batched", "sequential"])
@pytest.mark.parametrize("seed", range(10))
def test_random_forward_rollback_matches_fresh(mode, seed):
    rng = random.Random(seed)
    session = FakeSession()
    runner = LlamaCppRunner(session, eval_mode=mode)
    for _ in range(30):
        if runner.tokens and rng.random() < 0.35:
            runner.rollback(rng.randrange(0, len(runner.tokens) + 1))
        else:
            room = runner.max_context - len(runner.tokens)
            if room == 0:
                runner.reset()
                continue
            new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, min(room, 20)))]
            last_n = rng.choice([None, 1, rng.randint(1, len(new))])
            logits = runner.forward(new, last_n=last_n)
            want = last_n or len(new)
            assert logits.dtype == torch.float32 and logits.shape == (want, VOCAB)
            torch.testing.assert_close(logits, fresh_logits(runner.tokens)[-want:], rtol=0, atol=0)
        assert session.cache == runner.tokens


def test_long_input_is_chunked_and_only_wanted_rows_are_computed():
    session = FakeSession(n_batch=8)
    runner = LlamaCppRunner(session)
    runner.forward(list(range(20)), last_n=3)
    assert session.calls == [(0, 8, 0), (8, 8, 0), (16, 4, 3)]
    session.calls.clear()
    runner.forward([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], last_n=9)
    assert session.calls == [(20, 8, 7), (28, 2, 2)]


def test_sequential_mode_batches_only_the_prompt():
    session = FakeSession()
    runner = LlamaCppRunner(session, eval_mode="sequential")
    runner.forward([1, 2, 3, 4], last_n=1)  # empty cache: one batch
    runner.forward([5, 6, 7])
    assert session.calls == [(0, 4, 1), (4, 1, 1), (5, 1, 1), (6, 1, 1)]


def test_limits_and_errors():
    session = FakeSession(n_ctx=10)
    runner = LlamaCppRunner(session)
    with pytest.raises(ValueError):
        runner.forward([])
    with pytest.raises(ValueError):
        runner.forward([VOCAB])
    with pytest.raises(SpecdecError):
        runner.forward(list(range(11)))
    runner.forward([1, 2, 3])
    runner.rollback(7)  # past the end: nothing to drop
    assert runner.tokens == [1, 2, 3]
    with pytest.raises(ValueError):
        runner.rollback(-1)
    runner.reset()
    assert runner.tokens == [] and session.cache == []


def test_failed_decode_leaves_tokens_equal_to_the_cache():
    session = FakeSession(n_batch=4)
    runner = LlamaCppRunner(session)
    session.fail_at = 5
    with pytest.raises(SpecdecError):
        runner.forward(list(range(10)))
    assert runner.tokens == session.cache == [0, 1, 2, 3]
    session.fail_at = None
    torch.testing.assert_close(runner.forward([4]), fresh_logits([0, 1, 2, 3, 4])[-1:], rtol=0, atol=0)


def test_batch_invariance_of_builds(monkeypatch):
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    assert batch_invariant_build({"AVX2": "1", "REPACK": "1", "OPENMP": "1"})
    assert not batch_invariant_build({"AVX2": "1", "LLAMAFILE": "1"})
    assert not batch_invariant_build({"NEON": "1", "MATMUL_INT8": "1"})
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    assert not batch_invariant_build({"AVX2": "1"})


def test_engine_takes_runners_from_any_backend():
    # A fake llama.cpp target and a transformers draft with the same token ids: speculative == plain.
    from specdec.runtime.engine import Engine
    from tests.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(0, vocab_size=VOCAB + 100)
    draft = tiny_model("llama", 1, vocab_size=VOCAB)
    target = LlamaCppRunner(FakeSession(n_ctx=128), eos_token_ids=frozenset({10**6}))
    engine = Engine(target, tok, draft, tok)
    assert engine.target_runner is target and engine.eos_token_ids == frozenset({10**6, tok.eos_token_id} - {None})
    ids = [3, 4, 5]
    plain = engine.generate(ids, max_new_tokens=24, use_draft=False)
    spec = engine.generate(ids, max_new_tokens=24, num_speculative_tokens=4)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_engine_load_refuses_what_llama_cpp_cannot_load(tmp_path):
    from specdec.runtime.engine import Engine

    with pytest.raises(SpecdecError, match="unknown backend"):
        Engine.load("smollm2-135m", backend="vllm")
    # A transformers directory has no GGUF (or llama-cpp-python is missing): a clear error either way.
    with pytest.raises(SpecdecError, match="GGUF|llama-cpp-python"):
        Engine.load(str(tmp_path), backend="llamacpp")
    with pytest.raises(SpecdecError, match="GGUF|llama-cpp-python"):
        Engine.load("smollm2-135m", str(tmp_path), backend="hf", draft_backend="llamacpp")


# --- real models through llama.cpp (pytest -m real) ---------------------------------------------
#
# Contract tolerance: 0.  In exact mode on a batch-invariant build (what
# scripts/install-llamacpp.sh builds) llama.cpp's logits for a token do not
# depend on how the tokens were split into forwards, so they must be bitwise
# equal to a fresh runner's.

PROMPTS = [
    "def fibonacci(n):",
    "import json\n\ndef load_config(path):\n",
    "The three most important ideas in thermodynamics are",
]
MAX_NEW = 32
TOKENIZER_STRINGS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "  leading spaces,\ttabs\t\tand   runs    of spaces\n\n\n",
    "In 1969, 3 astronauts flew 384,400 km; 12345678901234567890 = 1.2e19?",
    "日本の首都は東京です。中文：我们今天学习",
    "Emoji check 🙂🚀 and accents: café naïve Ωμέγα Поиск",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "x",
]


@pytest.fixture
def lcpp(real_lcpp):
    """The session's llama.cpp runners (tests/conftest.py): get(name, exact=True)."""
    return real_lcpp


def plain_and_speculative(engine, prompts, k=4):
    for prompt in prompts:
        ids = engine.encode(prompt)
        plain = engine.generate(ids, max_new_tokens=MAX_NEW, use_draft=False)
        spec = engine.generate(ids, max_new_tokens=MAX_NEW, num_speculative_tokens=k)
        yield prompt, plain, spec


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"])
def test_llama_cpp_tokenizes_like_the_transformers_tokenizer(lcpp, name):
    runner, tok = lcpp(name)
    for text in TOKENIZER_STRINGS:
        for add_special in (False, True):
            hf = list(tok(text, add_special_tokens=add_special)["input_ids"])
            assert runner.session.tokenize(text, add_special=add_special, parse_special=True) == hf, (text, add_special)
    assert runner.eos_token_ids == {tok.eos_token_id}  # the same stop ids as the transformers copy


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_random_forward_rollback_matches_fresh_runner_bitwise(lcpp, name):
    from specdec.backends.llamacpp import LlamaCppRunner

    runner, tok = lcpp(name)
    if runner.eval_mode != "batched":
        why = ("this llama-cpp-python build is not batch-invariant (built with llamafile?); "
               "exact mode verifies one token at a time instead")
        pytest.fail(why) if in_ci() else pytest.skip(why)
    fresh = LlamaCppRunner(runner.session.__class__(runner.session.path, n_ctx=1024, n_threads=1), "batched")
    base = list(tok("class Stack:\n    def __init__(self):\n        self.items = []\n", add_special_tokens=True)["input_ids"])
    rng = random.Random(0)
    runner.reset()
    try:
        runner.forward(base, last_n=1)
        for _ in range(24):
            if rng.random() < 0.3 and len(runner.tokens) > len(base):
                runner.rollback(rng.randrange(len(base), len(runner.tokens) + 1))
                continue
            new = [rng.randrange(1000, 20000) for _ in range(rng.randint(1, 9))]
            logits = runner.forward(new)
            fresh.reset()
            expected = fresh.forward(runner.tokens, last_n=len(new))
            assert torch.equal(logits, expected), float((logits - expected).abs().max())
    finally:
        fresh.close()
        runner.reset()


def test_the_installed_build_verifies_a_draft_in_one_batch():
    # CI builds llama.cpp with scripts/install-llamacpp.sh, which must give a batch-invariant
    # build; elsewhere (a user's own build with llamafile) exact mode falls back to one token
    # at a time, which stays exact but slower.
    require_llama_cpp()
    if not batch_invariant_build():
        why = f"llama.cpp build is not batch-invariant: {build_features()}"
        pytest.fail(why) if in_ci() else pytest.skip(why)


class DecodeSizes:
    """Wraps a session's decode and records (cached tokens, tokens evaluated) per call."""

    def __init__(self, session) -> None:
        self.session, self.calls = session, []
        self.inner = session.decode

    def __call__(self, tokens, start, outputs):
        self.calls.append((start, len(tokens)))
        return self.inner(tokens, start, outputs)


@pytest.mark.real
def test_speculative_equals_plain_on_llama_cpp_same_tokenizer(lcpp, monkeypatch):
    from specdec.runtime.engine import Engine

    engine = Engine(*lcpp("qwen2.5-coder-1.5b"), *lcpp("qwen2.5-coder-0.5b", exact=False))
    session = engine.target_runner.session
    sizes = DecodeSizes(session)
    monkeypatch.setattr(session, "decode", sizes)
    drafted = accepted = 0
    for prompt, plain, spec in plain_and_speculative(engine, PROMPTS):
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.stats.target_forwards < plain.stats.target_forwards
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert accepted > 0.3 * drafted
    # Drafts were verified: several tokens in one llama_decode call on a non-empty cache
    # (batched), or one token per call (sequential, a build that is not batch-invariant).
    verify_calls = [n for start, n in sizes.calls if start > 0]
    if engine.target_runner.eval_mode == "batched":
        assert max(verify_calls) == 5  # pending token + a full draft of 4
    else:
        assert max(verify_calls) == 1


@pytest.mark.real
def test_speculative_equals_plain_on_llama_cpp_universal(lcpp):
    from specdec.runtime.engine import Engine

    engine = Engine(*lcpp("qwen2.5-coder-1.5b"), *lcpp("smollm2-135m", exact=False))
    assert engine.resolve_draft_mode("auto") == "text"
    for prompt, plain, spec in plain_and_speculative(engine, PROMPTS):
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.stats.accepted > 0


@pytest.mark.real
def test_intersection_mode_and_sampling_on_llama_cpp(lcpp):
    # Every drafter on either backend: the intersection drafter (its vocabulary map
    # sized from the GGUF's vocabulary) is exact under greedy decoding, and sampling
    # through llama.cpp logits is seeded-reproducible, with top-k = 1 equal to greedy.
    from specdec.algorithm.sampling import SamplingParams
    from specdec.runtime.engine import Engine

    engine = Engine(*lcpp("qwen2.5-coder-1.5b"), *lcpp("smollm2-135m", exact=False))
    prompt = PROMPTS[0]
    short = 16
    plain = engine.generate(prompt, max_new_tokens=short, use_draft=False)
    inter = engine.generate(prompt, max_new_tokens=short, num_speculative_tokens=4, draft_mode="intersection")
    assert inter.token_ids == plain.token_ids and inter.stats.drafted > 0
    top1 = SamplingParams(temperature=0.8, top_k=1, seed=3)
    for mode in ("text", "intersection"):
        out = engine.generate(prompt, max_new_tokens=short, sampling=top1, draft_mode=mode, num_speculative_tokens=4)
        assert out.token_ids == plain.token_ids
        warm = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
        first, again = (engine.generate(prompt, max_new_tokens=short, sampling=warm, draft_mode=mode,
                                        num_speculative_tokens=4) for _ in range(2))
        assert first.token_ids == again.token_ids and first.stats.drafted > 0


@pytest.fixture
def hf_target(real_hf):
    # int8 (exact, and five times faster than fp32), on the one torch thread conftest sets: on a
    # shared 2-core machine a second thread mostly waits while llama.cpp's threads spin.
    return real_hf("qwen2.5-coder-1.5b", "int8")


@pytest.fixture(scope="module")
def hf_plain(real_hf):
    from specdec.runtime.engine import Engine

    engine = Engine(*real_hf("qwen2.5-coder-1.5b", "int8"))
    return {p: engine.generate(p, max_new_tokens=MAX_NEW).token_ids for p in PROMPTS[:2]}


@pytest.mark.real
@pytest.mark.parametrize("draft", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_torch_target_with_llama_cpp_draft(lcpp, hf_target, hf_plain, draft):
    from specdec.runtime.engine import Engine

    engine = Engine(*hf_target, *lcpp(draft, exact=False))
    assert engine.resolve_draft_mode("auto") == ("same" if draft.startswith("qwen") else "text")
    for prompt, plain in hf_plain.items():
        spec = engine.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=4)
        assert spec.token_ids == plain, prompt
        assert spec.stats.accepted > 0


@pytest.mark.real
def test_cli_generate_on_llama_cpp(lcpp, cached_loaders):
    # `specdec generate --backend llamacpp` in-process, on the session's llama.cpp models
    # (default pair): the tokens are plain llama.cpp greedy decoding's.
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec.runtime.engine import Engine

    result = CliRunner().invoke(app, ["generate", "def fibonacci(n):", "--json", "-n", "16",
                                      "--backend", "llamacpp", "--threads", "1", "-k", "4"])
    assert result.exit_code == 0, result.output[-2000:]
    out = json.loads(result.stdout)
    plain = Engine(*lcpp("qwen2.5-coder-1.5b")).generate("def fibonacci(n):", max_new_tokens=16)
    assert out["token_ids"] == plain.token_ids and out["text"] == plain.text
    assert out["stats"]["accepted"] > 0


@pytest.mark.real
def test_tokenizer_of_an_unconverted_gguf_matches_the_converted_one(tmp_path, monkeypatch):
    # A .gguf file with no transformers conversion: its tokenizer is built from the GGUF alone
    # (no weights loaded) and cached; it must equal the tokenizer of the zoo's converted copy.
    from specdec import zoo
    from specdec.runtime.loading import gguf_file, load_tokenizer

    reference = load_tokenizer("smollm2-135m")
    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(gguf_file("smollm2-135m"))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    tok = load_tokenizer(str(gguf))
    assert list((tmp_path / "home" / "tokenizers").iterdir())  # cached, and no model was converted
    assert not (tmp_path / "home" / "hf").exists()
    assert tok.get_vocab() == reference.get_vocab() and tok.eos_token_id == reference.eos_token_id
    for text in TOKENIZER_STRINGS:
        assert tok(text)["input_ids"] == reference(text)["input_ids"]
    assert load_tokenizer(str(gguf)).get_vocab() == tok.get_vocab()  # from the cache
    assert zoo.home() == tmp_path / "home"
