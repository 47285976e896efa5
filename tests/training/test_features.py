"""The target's features for training: the bank's windows, teacher-forced text, and the target's own answers."""

from __future__ import annotations

import pytest
import torch

from specdec.training.features import FeatureBank, GenerationSource, TextSource, features
from tests.head.conftest import target_pass
from tests.tiny import tiny_model


def test_the_bank_keeps_ids_and_features_aligned() -> None:
    bank = FeatureBank(hidden=3, dtype=torch.float32)
    for start in (0, 100, 5000):  # grows past its first allocation
        ids = list(range(start, start + 40))
        bank.add(ids, torch.tensor(ids, dtype=torch.float32)[:, None].expand(40, 3))
    assert bank.length == 120
    ids, feats, answer = bank.windows(16, 8, torch.Generator().manual_seed(0))  # [16, 9], [16, 9, 3], [16, 9]
    assert ids.shape == (16, 9) and feats.shape == (16, 9, 3)
    assert torch.equal(feats[..., 0], ids.float()) and torch.equal(feats[..., 2], ids.float())
    assert not answer.any()


def test_focused_windows_hold_answer_positions() -> None:
    """A stream's answer is marked from its start on; with focus 1 every window holds an answer position, and
    the answer flags travel with their ids."""
    bank = FeatureBank(hidden=2, dtype=torch.float32)
    for start in range(0, 10_000, 100):  # streams of 100 tokens whose last 10 are the answer
        ids = list(range(start, start + 100))
        bank.add(ids, torch.zeros(100, 2), start=90)
    generator = torch.Generator().manual_seed(0)
    ids, _, answer = bank.windows(200, 16, generator, focus=1.0)  # [200, 17] each
    assert torch.equal(answer, ids % 100 >= 90)
    assert answer.any(dim=1).all()
    ids, _, answer = bank.windows(200, 16, generator)  # unfocused: a window of 17 misses the answers often
    assert not answer.any(dim=1).all()
    assert torch.equal(answer, ids % 100 >= 90)


def test_text_features_are_the_targets_post_norm_states(target: torch.nn.Module, text: list[list[int]]) -> None:
    source = TextSource(target, [text[0], text[1]], chunk=40)
    chunks = [c for produced in iter(source.produce, []) for c in produced]
    assert [c.ids for c in chunks] == [text[0][:40], text[0][40:], text[1][:40], text[1][40:]]
    expected, _ = target_pass(target, torch.tensor([text[0][:40]]))  # [1, 40, H] via the final norm's hook
    assert torch.allclose(chunks[0][1], expected[0], atol=1e-5)
    assert source.tokens() == text[0] + text[1]


def test_answers_are_greedy_and_their_features_those_of_a_teacher_forced_pass(target: torch.nn.Module) -> None:
    prompts = [[1, 5, 9, 2, 7, 3], [1, 40], [1, 12, 8]]  # different lengths: left padding in one batch
    eos = target.generation_config.eos_token_id
    source = GenerationSource(target, prompts, eos_ids=[] if eos is None else [eos], pad_id=0, max_new_tokens=12, batch=3)
    chunks = source.produce()
    assert source.produce() == []
    by_prompt = {tuple(ids[: len(p)]): (ids, feats) for p, (ids, feats, start) in zip(sorted(prompts, key=len), chunks)}
    assert [c.start for c in chunks] == sorted(map(len, prompts))  # the answers begin after the prompts
    for prompt in prompts:
        ids, feats = by_prompt[tuple(prompt)]
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
        assert ids == alone[: len(ids)] and len(ids) >= len(alone) - 1 > len(prompt)  # the last token may never be fed
        assert feats.shape == (len(ids), target.config.hidden_size)
        assert torch.allclose(feats, features(target, torch.tensor([ids]))[0], atol=1e-4)


def test_a_follow_up_prompt_is_answered_next_with_the_answer_it_was_built_from(target: torch.nn.Module) -> None:
    prompts = [[1, 5, 9], [1, 40, 3], [1, 12, 8], [1, 7, 7]]  # one length: answered in this order
    seen: dict[int, list[int]] = {}

    def follow_up(i: int, answer: list[int]) -> list[int] | None:
        seen[i] = answer
        return [1, 33] + answer[:2] if i == 0 else None  # only the first prompt goes on

    source = GenerationSource(target, prompts, eos_ids=[], pad_id=0, max_new_tokens=6, batch=2, follow_up=follow_up)
    batches = [[c.ids for c in source.produce()] for _ in range(3)]
    assert source.produce() == []
    assert [[ids[:3] for ids in batch] for batch in batches] == [
        prompts[:2], [[1, 33] + seen[0][:1], prompts[2]], [prompts[3]]]  # the follow-up before the rest
    for i, prompt in enumerate(prompts):
        ids = next(ids for batch in batches for ids in batch if ids[:3] == prompt)
        assert seen[i] == ids[3:] and len(seen[i]) >= 5  # the answer, less a last token never fed
    assert batches[1][0][:4] == [1, 33] + seen[0][:2] and sorted(seen) == [0, 1, 2, 3]


def test_an_answer_ends_after_its_end_token(target: torch.nn.Module) -> None:
    prompt = [1, 40]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    stop = greedy[len(prompt) + 3]  # the 4th answer token plays the end-of-sequence token
    (ids, feats, _), = GenerationSource(target, [prompt], [stop], pad_id=0, max_new_tokens=12).produce()
    end = greedy.index(stop, len(prompt))  # the end token itself is kept only where it was fed
    assert ids in (greedy[:end], greedy[: end + 1]) and len(feats) == len(ids)


def test_lean_answers_are_the_int8_runners_greedy_tokens_and_features() -> None:
    """The lean extractor's packed batch answers each prompt as the int8 runner alone does, and its features
    are a teacher-forced prefill's, bitwise (int8 is batch-invariant)."""
    from specdec.native.lean import LeanRunner
    from specdec.native.quant import quantize_model
    from specdec.training.features import LeanExtractor
    from tests.tiny import tiny_model

    runner = LeanRunner(quantize_model(tiny_model("qwen2", 0)))
    extractor = LeanExtractor(runner, batch=2)
    prompts = [[1, 5, 9, 2, 7, 3], [1, 40], [1, 12, 8]]  # three prompts, two a batch: a second batch
    alone = LeanRunner(runner.model)

    def greedy(prompt: list[int], n: int) -> list[int]:
        alone.reset()
        out, logits = list(prompt), alone.forward(prompt, last_n=1)
        for _ in range(n):
            out.append(int(logits[-1].argmax()))
            logits = alone.forward(out[-1:], last_n=1)
        return out

    stop = greedy(prompts[1], 4)[-1]  # prompt 1's 4th answer token plays the end-of-sequence token
    chunks = extractor.answer(prompts, {stop}, max_new_tokens=10)
    for prompt, (ids, feats, start) in zip(prompts, chunks):
        assert start == len(prompt)
        full = greedy(prompt, 10)
        end = next((i for i in range(len(prompt), len(full)) if full[i] == stop), len(full) - 1)
        assert ids == full[:end]  # up to the end token or the 10th answer token, neither ever fed
        assert torch.equal(feats, extractor.features(ids)) and torch.equal(feats, features(extractor, torch.tensor([ids]))[0])
    assert len(chunks[1][0]) == len(prompts[1]) + 3
    long = list(range(3, 3 + 90)) * 3  # 270 tokens, a window of 256: two pieces, each from an empty cache
    feats = extractor.features(long)
    assert feats.shape == (270, runner.model.config.hidden_size)
    assert torch.equal(feats[:256], extractor.features(long[:256])) and torch.equal(feats[256:], extractor.features(long[256:]))


def test_lean_answers_stay_within_the_targets_window() -> None:
    from specdec.native.lean import LeanRunner
    from specdec.native.quant import quantize_model
    from specdec.training.features import LeanExtractor
    from tests.tiny import tiny_model

    extractor = LeanExtractor(LeanRunner(quantize_model(tiny_model("llama", 0, positions=64))), batch=2)
    (ids, feats, start), (short, _, _) = extractor.answer([list(range(3, 83)), [1, 5]], eos=set(), max_new_tokens=30)
    assert ids[:63] == list(range(20, 83)) and len(ids) == feats.shape[0] == 64  # the prompt's last 63, then 1 fed
    assert start == 63
    assert len(short) == 2 + 29  # the other answer as long as asked (its 30th token never fed)


def test_tapped_layers_follow_the_final_feature() -> None:
    """With taps, a position's feature is the final feature, then the residual stream after each tapped layer:
    what hooks on those layers see, teacher-forced and while the target answers."""
    target = tiny_model("llama", 0, layers=3)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11]])
    seen: dict[int, torch.Tensor] = {}
    layers = target.get_decoder().layers
    hooks = [layers[i].register_forward_hook(lambda _m, _i, out, i=i: seen.__setitem__(
        i, out[0] if isinstance(out, tuple) else out)) for i in (0, 1)]
    try:
        final, _ = target_pass(target, ids)  # [1, 7, H]
    finally:
        for hook in hooks:
            hook.remove()
    h = target.config.hidden_size
    tapped = features(target, ids, taps=(0, 1))  # [1, 7, 3H]
    assert tapped.shape == (1, 7, 3 * h)
    assert torch.allclose(tapped[..., :h], final, atol=1e-5)
    assert torch.allclose(tapped[..., h: 2 * h], seen[0], atol=1e-5) and torch.allclose(tapped[..., 2 * h:], seen[1], atol=1e-5)
    (answer, feats, _), = GenerationSource(target, [[1, 5, 9]], eos_ids=[], pad_id=0, max_new_tokens=6, taps=(1,)).produce()
    assert feats.shape == (len(answer), 2 * h)
    assert torch.allclose(feats, features(target, torch.tensor([answer]), taps=(1,))[0], atol=1e-4)


def test_lean_tapped_rows_are_the_int8_models_layer_outputs() -> None:
    """The lean runner's tapped rows are the quantized transformers model's layer outputs, bitwise (its numbers
    are that model's), in a prefill and in the packed answers alike; taps off gives the final feature alone."""
    from specdec.native.lean import LeanRunner
    from specdec.native.quant import quantize_model
    from specdec.training.features import LeanExtractor, check_taps

    model = quantize_model(tiny_model("qwen2", 0, layers=3))
    extractor = LeanExtractor(LeanRunner(model), batch=2)
    h = model.config.hidden_size
    (ids, feats, _), _ = extractor.answer([[1, 5, 9, 2], [1, 40]], eos=set(), max_new_tokens=6, taps=(0, 1))
    assert feats.shape == (len(ids), 3 * h)
    assert torch.equal(feats, extractor.features(ids, taps=(0, 1)))
    assert torch.equal(feats, features(model, torch.tensor([ids]), taps=(0, 1))[0])
    assert torch.equal(extractor.features(ids), feats[:, :h])
    assert check_taps([0, 1], 3) == (0, 1)
    for bad in ([2], [1, 0], [0, 0], [-1]):
        with pytest.raises(ValueError, match="tapped layers"):
            check_taps(bad, 3)


def test_a_source_skips_what_an_earlier_run_consumed(target: torch.nn.Module, text: list[list[int]]) -> None:
    text_source = TextSource(target, text[:2], chunk=25)
    text_source.produce()
    text_source.produce()
    assert text_source.consumed == 2
    later = TextSource(target, text[:2], chunk=25)
    later.skip(text_source.consumed)
    assert later.produce()[0].ids == text_source.produce()[0].ids
    later.skip(len(later.pieces) + 1)  # past the end: from the start again
    assert later.produce()[0].ids == later.pieces[1]

    prompts = [[1, 5, 9], [1, 40, 3], [1, 12, 8], [1, 7, 7], [1, 9, 2]]  # one length: answered in this order

    def follow_up(i: int, answer: list[int]) -> list[int] | None:
        return [1, 33] + answer[:2] if i == 0 else None

    source = GenerationSource(target, prompts, eos_ids=[], pad_id=0, max_new_tokens=4, batch=2, follow_up=follow_up)
    source.produce()
    source.produce()  # the follow-up to prompt 0, then prompt 2
    assert source.consumed == 3  # given prompts answered: 0, 1 and 2 (the follow-up is not one)
    resumed = GenerationSource(target, prompts, eos_ids=[], pad_id=0, max_new_tokens=4, batch=2)
    resumed.skip(source.consumed)
    assert [c.ids[:3] for c in resumed.produce()] == [prompts[3], prompts[4]]
    resumed.skip(len(prompts) + 1)
    assert resumed.consumed == 1 and resumed.produce()[0].ids[:3] == prompts[1]
