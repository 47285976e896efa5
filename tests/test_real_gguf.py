"""The gguf target on real files (specdec.native.gguf): batch-invariant bitwise, so speculative == plain.

For the zoo's llama-family and qwen2 files: on random forward / rollback sequences with 1..16 new tokens per
forward, every token's logits are bitwise the ones a runner that evaluates one token at a time computes
(contexts up to 1k tokens for smollm2-135m, 512 for the 0.5B, 256 for the 1.5B, to bound the time).  Then the
qwen2.5-coder-1.5b gguf target -- what `specdec generate` runs by default -- gives its own plain greedy output
with every drafter: the 0.5B in int4 (the default hybrid with lookup), the 0.5B on its own blocks, and suffix
drafts; the README's first command runs it.  Marked `real`.
"""

from __future__ import annotations

import pytest

from specdec.runtime.engine import Engine
from specdec.runtime.runners import fastest_dtype
from tests.conftest import real_model_threads
from tests.real_checks import PROMPTS, assert_bitwise_one_token_at_a_time, plain_outputs, speculative_outputs

pytestmark = pytest.mark.real


@pytest.mark.parametrize("name, context", [("smollm2-135m", 1024), ("qwen2.5-coder-0.5b", 512),
                                           ("qwen2.5-coder-1.5b", 256)])
def test_gguf_logits_are_bitwise_one_token_at_a_time(real_gguf, name, context):
    runner, tok = real_gguf(name)
    mirror, _ = real_gguf(name)  # another cache over the same loaded model
    assert_bitwise_one_token_at_a_time(runner, mirror, tok, name, context)


@pytest.fixture(scope="module")
def gguf_target(real_gguf):
    return real_gguf("qwen2.5-coder-1.5b")


@pytest.fixture(scope="module")
def gguf_plain(gguf_target):
    return plain_outputs(Engine(*gguf_target))


def test_every_drafter_leaves_the_gguf_targets_output_unchanged(real_hf, real_gguf, gguf_target, gguf_plain):
    from specdec.native.lean import LeanRunner

    draft_model, draft_tokenizer = real_hf("qwen2.5-coder-0.5b", "int8")
    int4 = LeanRunner(draft_model, int4=True)
    own_blocks, own_tokenizer = real_gguf("qwen2.5-coder-0.5b")
    cases = [  # (draft runner and tokenizer or None, lookup / suffix, k, prompts)
        ((int4, draft_tokenizer), dict(lookup=True), "auto", PROMPTS),  # the default: lookup + the int4 0.5B
        ((own_blocks, own_tokenizer), {}, 3, PROMPTS[::2]),  # the 0.5B on its own file's blocks, a fixed γ
        ((), dict(suffix=True), "auto", PROMPTS[1::2]),  # suffix drafts: the context and earlier answers
    ]
    for draft, copying, k, prompts in cases:
        engine = Engine(*gguf_target, *draft, **copying)
        outputs, drafted, accepted = speculative_outputs(engine, prompts, k)
        assert outputs == {p: gguf_plain[p] for p in prompts}, (k, copying)
        assert drafted > 0 and accepted > 0


def test_the_readmes_first_command_runs_the_gguf_target(gguf_plain, cached_loaders):
    # `specdec generate "def fibonacci(n):"` as a new user runs it (every default: dtype auto, the lookup +
    # 0.5B hybrid, -k auto), in-process with the session's loaded models: the target is the gguf file's own
    # blocks where specdec's kernels run SIMD, the summary says so, and the tokens are gguf plain's.
    import json

    from typer.testing import CliRunner

    from specdec.cli import app

    if fastest_dtype("qwen2.5-coder-1.5b") != "gguf":
        pytest.skip("gguf is the default only on CPUs with AVX2 or AVX-512 VNNI")
    prompt = PROMPTS[0]
    with real_model_threads():
        summary = CliRunner().invoke(app, ["generate", prompt, "--max-new-tokens", "24"])
        result = CliRunner().invoke(app, ["generate", prompt, "--json", "--max-new-tokens", "24"])
    assert summary.exit_code == 0, summary.output[-2000:]
    assert "target qwen2.5-coder-1.5b gguf" in " ".join(summary.output.split())
    assert result.exit_code == 0, result.output[-2000:]
    assert json.loads(result.stdout)["token_ids"] == gguf_plain[prompt][:24]
