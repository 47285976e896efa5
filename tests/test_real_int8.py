"""Real models in int8 (specdec.native.quant): batch-invariant bitwise, so speculative == plain, always.

For the zoo's drafts (the 1.5B target runs on its own blocks by default: tests/test_real_gguf.py): on random
forward / rollback sequences with 1..16 new tokens per forward and contexts up to 1k tokens (512 for the
0.5B, to bound the time), every token's logits are bitwise the ones a runner that
evaluates one token at a time computes.  Then the int8 qwen2.5-coder-1.5b
target's speculative greedy output equals its own plain greedy output token
for token with the int8 0.5B draft, and with its weights in int4 (llama.cpp drafts: tests/backends/
test_llamacpp.py; drafts of another tokenizer: tests/test_real_universal.py).
Marked `real`; the int8 copies are quantized once and cached in the user's
model cache.
"""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.engine import Engine, as_runner
from tests.conftest import real_model_threads
from tests.real_checks import CODE, MAX_NEW, PROMPTS, assert_bitwise_one_token_at_a_time, plain_outputs, speculative_outputs

pytestmark = pytest.mark.real

@pytest.mark.parametrize("name, context", [("smollm2-135m", 1024), ("gemma3-270m", 1024),
                                           ("qwen2.5-coder-0.5b", 512)])
def test_int8_logits_are_bitwise_one_token_at_a_time(real_hf, name, context):
    model, tok = real_hf(name, "int8")
    runner, mirror = as_runner(model), as_runner(model)  # what the Engine uses: lean for qwen2 / llama
    assert_bitwise_one_token_at_a_time(runner, mirror, tok, name, context)


def test_lean_runner_is_bitwise_the_quantized_transformers_model(real_hf):
    # Real shapes (qwen2: q/k/v biases, grouped queries): the lean runner's fused projections and
    # own cache compute exactly what the quantized transformers modules compute.
    from specdec.backends.hf import HFRunner
    from specdec.native.lean import LeanRunner

    model, tok = real_hf("qwen2.5-coder-0.5b", "int8")
    lean, reference = LeanRunner(model), HFRunner(model)
    ids = list(tok(CODE, add_special_tokens=True)["input_ids"])
    with real_model_threads():
        assert torch.equal(lean.forward(ids), reference.forward(ids))
        for k in (1, 5, 16):
            new = ids[-k:]
            assert torch.equal(lean.forward(new), reference.forward(new)), k


@pytest.fixture(scope="module")
def int8_target(real_hf):
    return real_hf("qwen2.5-coder-1.5b", "int8")


@pytest.fixture(scope="module")
def int8_plain(int8_target):
    return plain_outputs(Engine(*int8_target))


def test_int8_speculative_equals_int8_plain_same_tokenizer(real_hf, int8_target, int8_plain):
    engine = Engine(*int8_target, *real_hf("qwen2.5-coder-0.5b", "int8"))
    outputs, drafted, accepted = speculative_outputs(engine, PROMPTS)
    assert outputs == int8_plain
    assert accepted > 0.3 * drafted


def test_int4_draft_leaves_int8_output_unchanged(real_hf, int8_target, int8_plain):
    # The 0.5B's weights in int4 (specdec.native.int4): another draft's numbers, the same output,
    # for a fixed γ and for -k auto with prompt lookup (the default draft on AVX2-only CPUs).
    from specdec.native.lean import LeanRunner

    draft_model, draft_tokenizer = real_hf("qwen2.5-coder-0.5b", "int8")
    draft = LeanRunner(draft_model, int4=True)
    prompts = PROMPTS[::2]  # a code and a prose prompt: CI's time
    for k, lookup in ((3, False), ("auto", True)):
        engine = Engine(*int8_target, draft, draft_tokenizer, lookup=lookup)
        outputs, drafted, accepted = speculative_outputs(engine, prompts, k=k)
        assert outputs == {p: int8_plain[p] for p in prompts}
        assert accepted > 0.3 * drafted > 0


def test_int8_batched_requests_equal_int8_plain(real_hf, int8_target, int8_plain):
    # Continuous batching (specdec.runtime.batching) on the real 1.5B: four requests from four threads, three
    # speculative with lookup + the int8 0.5B draft (k auto, or fixed), one plain, all in packed
    # forwards with each other: each output equals its plain output alone (bitwise invariance).
    import threading

    engine = Engine(*int8_target, *real_hf("qwen2.5-coder-0.5b", "int8"), lookup=True)
    engine.enable_batching(4)
    ks = ["auto", 4, "auto", None]  # None: plain decoding inside the batch
    outputs: dict = {}

    def run(prompt, k):
        outputs[prompt] = engine.generate(prompt, max_new_tokens=MAX_NEW, use_draft=k is not None,
                                          num_speculative_tokens=k or 1).token_ids

    with real_model_threads():
        threads = [threading.Thread(target=run, args=(p, k)) for p, k in zip(PROMPTS, ks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    assert outputs == int8_plain
    assert engine.pool.target.batched > engine.pool.target.forwards  # forwards served several requests at once
