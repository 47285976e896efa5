"""Encoder-decoder models (specdec.backends.seq2seq) through the one decode loop.

Tiny random T5 models built here (d_model 32; target 2 layers, draft 1 layer, and
a "near" draft: the target with its weights perturbed, which agrees often but not
always) and a tiny BART, all over the vocabulary of tests.tiny.tiny_tokenizer()
with the decoder starting from the pad id 0 (T5) or EOS (BART).  The weights
are redrawn wider than T5's own init (see tiny_t5) so that greedy outputs vary
along a generation and stay far from ties.

Stairs verification (specdec.algorithm.stairs) over the same pairs: identical to plain
greedy too, with the same adversarial drafts.

Backend contract: the runner's logits equal the model's own full forward (no
cache) after any sequence of forwards and rollbacks; the cross-attention cache
survives rollback and reset.  Loop: plain greedy == ``model.generate``;
speculative greedy == plain greedy for γ = 1..6 and adversarial drafts; seeded
sampling through the loop matches the exact distribution (chi-square).  Engine
and CLI: saved model directories load as seq2seq models, speculative == plain,
and mixing an encoder-decoder with a decoder-only model is refused in one line.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Sequence
from functools import cache

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration
from typer.testing import CliRunner

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.stairs import stairs_runner
from specdec.algorithm.verify import make_verifier
from specdec.backends.seq2seq import Seq2SeqRunner, is_seq2seq
from specdec.drafters.model import ModelDrafter
from specdec.errors import IncompatibleDraftError, SpecdecError
from specdec.runtime.engine import Engine
from tests.chisq import chi_square
from tests.tiny import save_tiny, tiny_model, tiny_tokenizer
from tests.toy import ConstantDrafter, reference_warp

TOKENIZER = tiny_tokenizer()
VOCAB = len(TOKENIZER)
EOS = TOKENIZER.eos_token_id  # 2
TEXTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, a small model", "for i in range(10):"]
SOURCES = [TOKENIZER(t)["input_ids"] for t in TEXTS]
MAX_NEW = 24


def tiny_t5(layers: int = 2, seed: int = 0, vocab_size: int = VOCAB) -> T5ForConditionalGeneration:
    """A small fp32 T5 whose weights are redrawn wide: T5's own init gives a tiny random model that
    repeats one token; larger attention weights and relative-position biases make the decoder's
    output depend on where it is and what it wrote."""
    config = T5Config(
        vocab_size=vocab_size, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=layers,
        num_decoder_layers=layers, relative_attention_num_buckets=16, relative_attention_max_distance=32,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=EOS, decoder_start_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or name.startswith("lm_head"):
                continue  # RMSNorm scales stay 1; the head keeps T5's init (logits spread ~5)
            if "relative_attention_bias" in name:
                p.normal_(0.0, 2.0)
            elif name.startswith("shared") or "embed_tokens" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 3.0 / p.shape[1] ** 0.5)  # [out, in]
    return model


def tiny_bart(seed: int = 0, layers: int = 1) -> BartForConditionalGeneration:
    """A small fp32 BART (learned positions: a window of 64 decoder tokens)."""
    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        init_std=0.4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=EOS, decoder_start_token_id=EOS, forced_eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return BartForConditionalGeneration(config).eval()


def perturbed(model: T5ForConditionalGeneration, scale: float = 0.05, seed: int = 5) -> T5ForConditionalGeneration:
    """A copy of `model` with noise on every weight: a draft that agrees with it often, not always."""
    near = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return near


TARGET = tiny_t5(2, 0)
DRAFT = tiny_t5(1, 1)
NEAR = perturbed(TARGET)
BART = tiny_bart(0)
BART_DRAFT = tiny_bart(1)
MODELS = {"t5": TARGET, "bart": BART}


def runner(model, source: Sequence[int] | None = None) -> Seq2SeqRunner:
    r = Seq2SeqRunner(model)
    if source is not None:
        r.set_source(source)
    return r


def full_logits(model, source: Sequence[int], decoder_ids: Sequence[int]) -> torch.Tensor:
    """The model's own forward over the whole decoder input, no cache: [len(decoder_ids), V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(source)]), decoder_input_ids=torch.tensor([list(decoder_ids)]),
                     use_cache=False).logits[0]


@cache
def plain(name: str, source: tuple[int, ...], max_new: int = MAX_NEW) -> tuple[int, ...]:
    r = runner(MODELS[name], source)
    return tuple(run(r, r.decoder_prompt(), StopCondition(max_new)).token_ids)


# --------------------------------------------------------------------------- the runner


def test_is_seq2seq_and_decoder_prompt():
    assert is_seq2seq(TARGET) and is_seq2seq(BART) and not is_seq2seq(tiny_model("llama"))
    assert runner(TARGET).decoder_prompt() == [0]  # T5 starts from the pad id
    assert runner(BART).decoder_prompt() == [EOS]  # BART from EOS
    t5, bart = runner(TARGET), runner(BART)
    assert (t5.vocab_size, bart.vocab_size) == (VOCAB, VOCAB)
    assert t5.max_context == 2**31 - 1  # relative positions: no window
    assert bart.max_context == 64  # learned positions
    assert t5.capabilities.rollback and t5.capabilities.logits_all_positions
    assert not t5.capabilities.batch_invariant
    with pytest.raises(SpecdecError, match="not an encoder-decoder"):
        Seq2SeqRunner(tiny_model("llama"))


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_logits_equal_the_full_forward(name):
    model, source = MODELS[name], SOURCES[1]
    r = runner(model, source)
    decoder = r.decoder_prompt() + [17, 40, 41, 99, 5, 250, 3]
    chunks = [r.forward(decoder[:1]), r.forward(decoder[1:4]), r.forward(decoder[4:7]), r.forward(decoder[7:])]
    got = torch.cat(chunks)  # [8, V]
    assert got.shape == (len(decoder), VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, full_logits(model, source, decoder), rtol=1e-4, atol=1e-4)
    r.reset()
    last = r.forward(decoder, last_n=2)
    torch.testing.assert_close(last, full_logits(model, source, decoder)[-2:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("seed", range(3))
def test_random_forward_rollback_matches_a_fresh_runner(name, seed):
    import random

    rng = random.Random(seed)
    model, source = MODELS[name], SOURCES[seed]
    r = runner(model, source)
    cross = None
    for _ in range(14):
        if r.tokens and rng.random() < 0.4:
            r.rollback(rng.randrange(0, len(r.tokens) + 1))
            assert r.cache.self_attention_cache.get_seq_length() == len(r.tokens)
            continue
        new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        logits = r.forward(new)
        torch.testing.assert_close(logits, full_logits(model, source, r.tokens)[-len(new):], rtol=1e-4, atol=1e-4)
        assert r.cache.self_attention_cache.get_seq_length() == len(r.tokens)
        keys = r.cross_cache.layers[0].keys  # [1, heads, S, d_kv]: computed once per source
        assert keys.shape[-2] == len(source)
        assert cross is None or keys is cross
        cross = keys


def test_reset_keeps_the_source_and_set_source_replaces_it():
    r = runner(TARGET, SOURCES[0])
    first = r.forward([0, 5, 6])
    r.reset()
    assert r.tokens == [] and r.source == SOURCES[0]
    torch.testing.assert_close(r.forward([0, 5, 6]), first)
    r.set_source(SOURCES[2])
    assert r.tokens == []
    torch.testing.assert_close(r.forward([0, 5, 6]), full_logits(TARGET, SOURCES[2], [0, 5, 6]), rtol=1e-4, atol=1e-4)
    r.rollback(0)
    assert r.tokens == [] and r.cache.get_seq_length() == 0
    with pytest.raises(ValueError):
        r.rollback(-1)


def test_no_source_and_empty_source_are_user_errors():
    with pytest.raises(SpecdecError, match="set_source"):
        runner(TARGET).forward([0])
    with pytest.raises(SpecdecError, match="empty"):
        runner(TARGET).set_source([])
    with pytest.raises(SpecdecError, match="encoder's 64 positions"):
        runner(BART).set_source([5] * 65)


def test_bf16_runner_returns_fp32_logits():
    r = runner(copy.deepcopy(TARGET).to(torch.bfloat16), SOURCES[0])
    logits = r.forward([0, 5, 6])
    assert logits.dtype == torch.float32 and logits.shape == (3, VOCAB)


# --------------------------------------------------------------------------- the decode loop


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_plain_greedy_equals_transformers_generate(name):
    model = MODELS[name]
    for source in SOURCES:
        theirs = model.generate(torch.tensor([source]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                forced_eos_token_id=None, min_length=0)[0].tolist()
        assert theirs[0] == runner(model).decoder_prompt()[0]
        assert list(plain(name, tuple(source))) == theirs[1:]
    assert len({plain(name, tuple(s)) for s in SOURCES}) == len(SOURCES)  # the source matters


def drafter(kind: str, source: Sequence[int], params: SamplingParams | None = None):
    """A drafter for the T5 target over `source`: the target itself, the near copy, the 1-layer
    unrelated draft (each a ModelDrafter over its own runner, its encoder run over the source),
    or a constant token."""
    if kind == "constant":
        return ConstantDrafter(7)
    model = {"self": TARGET, "near": NEAR, "other": DRAFT}[kind]
    return ModelDrafter(runner(model, source), params)


def speculative(source: Sequence[int], kind: str, gamma: int, max_new: int = MAX_NEW, eos: frozenset[int] = frozenset(),
                verify: str = "causal"):
    """Speculative greedy decoding of the T5 target; verify "stairs": through its staircase of
    next-token queries (specdec.algorithm.stairs) instead of one causal forward."""
    target = runner(TARGET, source)
    prompt = target.decoder_prompt()
    if verify == "stairs":
        target = stairs_runner(target)
    return run(target, prompt, StopCondition(max_new, eos_token_ids=eos),
               drafter=drafter(kind, source), num_speculative_tokens=gamma)


@pytest.mark.parametrize("gamma", range(1, 7))
@pytest.mark.parametrize("kind", ["self", "near", "other", "constant"])
def test_speculative_greedy_equals_plain_greedy(kind, gamma):
    for source in (SOURCES[gamma % 4], SOURCES[(gamma + 1) % 4]):
        out = speculative(source, kind, gamma)
        assert out.token_ids == list(plain("t5", tuple(source)))
        if kind == "self":
            assert out.stats.acceptance_rate == 1.0
            assert out.stats.target_forwards <= 1 + -(-(MAX_NEW - 1) // (gamma + 1)) + 1


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("kind", ["self", "near", "other", "constant"])
def test_stairs_greedy_equals_plain_greedy(kind, gamma):
    for source in SOURCES[:2]:
        out = speculative(source, kind, gamma, verify="stairs")
        assert out.token_ids == list(plain("t5", tuple(source)))
        if kind == "self":
            assert out.stats.acceptance_rate == 1.0


def test_the_near_draft_is_partly_accepted():
    rates = [speculative(source, "near", 4).stats.acceptance_rate for source in SOURCES[:2]]
    assert 0 < sum(rates) / len(rates) < 1  # some drafts are cut by a rejection: the rollback path runs


@pytest.mark.parametrize("verify", ["causal", "stairs"])
def test_eos_inside_the_draft_stops_there(verify):
    source = SOURCES[1]
    reference = list(plain("t5", tuple(source), 40))
    eos = reference[9]  # pretend this token is EOS: generation ends at its first occurrence
    first = reference.index(eos)
    for kind in ("self", "near", "other"):
        for gamma in (3, 6):
            out = speculative(source, kind, gamma, max_new=40, eos=frozenset({eos}), verify=verify)
            assert out.token_ids == reference[: first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("verify", ["causal", "stairs"])
def test_max_new_tokens_smaller_than_gamma(verify):
    source = SOURCES[2]
    reference = list(plain("t5", tuple(source)))
    for max_new in range(1, 6):
        for kind in ("self", "constant"):
            out = speculative(source, kind, 6, max_new=max_new, verify=verify)
            assert out.token_ids == reference[:max_new] and out.finish_reason == "length"


def test_bart_speculative_equals_plain():
    for source in SOURCES[:2]:
        target = runner(BART, source)
        for draft in (BART, BART_DRAFT):
            out = run(target, target.decoder_prompt(), StopCondition(MAX_NEW),
                      drafter=ModelDrafter(runner(draft, source)), num_speculative_tokens=4)
            assert out.token_ids == list(plain("bart", tuple(source)))


def test_bart_window_ends_generation():
    target = runner(BART, SOURCES[0])
    out = run(target, target.decoder_prompt(), StopCondition(100), drafter=ModelDrafter(runner(BART_DRAFT, SOURCES[0])),
              num_speculative_tokens=5)
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 1  # the start token takes a position
    assert out.token_ids == list(plain("bart", tuple(SOURCES[0]), 100))


# --------------------------------------------------------------------------- sampling

SAMPLE_SOURCE = SOURCES[0]
SAMPLE_PARAMS = dict(temperature=3.0, top_k=2)  # two tokens a position, none rare (exact p >= 0.04)
SAMPLE_NEW = 3  # the prefill's token, then a 1-token draft: accepted with its bonus, or rejected and resampled
SAMPLE_RUNS = 500  # in this process, ~8 s (a worker process would first spend ~7 s importing torch)


def flatter(model: T5ForConditionalGeneration, factor: float = 0.3) -> T5ForConditionalGeneration:
    """A copy of `model` with its head scaled down: the same ranking of tokens, a flatter distribution."""
    flat = copy.deepcopy(model)
    with torch.no_grad():
        flat.lm_head.weight.mul_(factor)
    return flat


# q has p's two tokens with other weights, so a rejection resamples from max(p - q, 0), which is not p:
# with that bug planted (the residual = p), this test gives chi2 = 65 with 7 dof (p = 2e-11).
SAMPLE_DRAFT = flatter(TARGET)


def exact_distribution(params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """Every continuation's probability under plain sampling from the T5 target (float64, through
    tests.toy.reference_warp, with logits of the full no-cache forward)."""
    start = runner(TARGET).decoder_prompt()
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            out[tuple(prefix)] = prob
            return
        logits = full_logits(TARGET, SAMPLE_SOURCE, start + prefix)[-1]  # [V]
        warped = reference_warp(logits, params.temperature, params.top_k, params.top_p)  # [V] float64
        for token in torch.nonzero(warped).flatten().tolist():
            walk(prefix + [token], prob * float(warped[token]))

    walk([], 1.0)
    return out


def sample_runs(seeds: range) -> dict:
    """Histogram of the new tokens of one seeded run per seed (through SAMPLE_DRAFT), and draft totals."""
    counts: Counter = Counter()
    drafted = accepted = 0
    target, draft = runner(TARGET, SAMPLE_SOURCE), runner(SAMPLE_DRAFT, SAMPLE_SOURCE)
    for seed in seeds:
        params = SamplingParams(seed=seed, **SAMPLE_PARAMS)
        out = run(target, target.decoder_prompt(), StopCondition(SAMPLE_NEW), drafter=ModelDrafter(draft, params),
                  num_speculative_tokens=1, verifier=make_verifier(params))
        counts[tuple(out.token_ids)] += 1
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    return {"counts": counts, "drafted": drafted, "accepted": accepted}


def test_speculative_sampling_matches_the_target_distribution():
    # Acceptances with a bonus token, rejections with a residual sample and plain steps after them
    # all occur (acceptance 0.74).  Seeds 0..499 are fixed: p = 0.851 (torch 2.13 CPU).
    exact = exact_distribution(SamplingParams(**SAMPLE_PARAMS), SAMPLE_NEW)
    assert len(exact) == 2**SAMPLE_NEW and abs(sum(exact.values()) - 1) < 1e-9
    totals = sample_runs(range(SAMPLE_RUNS))
    stat, dof, p_value = chi_square(totals["counts"], exact)
    print(f"chi2={stat:.1f} dof={dof} p={p_value:.4f} acceptance={totals['accepted'] / totals['drafted']:.3f}")
    assert 0.5 < totals["accepted"] / totals["drafted"] < 0.9
    assert p_value > 0.001, f"chi2={stat:.1f} with {dof} dof, p={p_value:.2e}"


@pytest.mark.parametrize("kind", ["near", "other"])
def test_degenerate_sampling_is_greedy(kind):
    reference = list(plain("t5", tuple(SOURCES[3])))
    target = runner(TARGET, SOURCES[3])
    for seed in range(2):
        params = SamplingParams(temperature=1.0, top_k=1, seed=seed)
        out = run(target, target.decoder_prompt(), StopCondition(MAX_NEW), drafter=drafter(kind, SOURCES[3], params),
                  num_speculative_tokens=3, verifier=make_verifier(params))
        assert out.token_ids == reference


# --------------------------------------------------------------------------- engine and CLI


def save_seq2seq(directory, model, tokenizer=TOKENIZER) -> str:
    """Save a tiny seq2seq model with a tiny tokenizer as a transformers directory."""
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


OTHER_TOKENIZER = tiny_tokenizer(variant=1)  # another vocabulary


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq2seq")
    return {
        "target": save_seq2seq(root / "t5-target", TARGET),
        "draft": save_seq2seq(root / "t5-draft", NEAR),
        "other-vocab": save_seq2seq(root / "t5-other-vocab", tiny_t5(1, 2, vocab_size=len(OTHER_TOKENIZER)),
                                    OTHER_TOKENIZER),
        "llama": save_tiny(root / "llama", "llama"),
    }


def test_engine_loads_seq2seq_directories_and_speculates_exactly(dirs):
    engine = Engine.load(dirs["target"], draft=dirs["draft"])
    assert isinstance(engine.target_runner, Seq2SeqRunner) and isinstance(engine.draft_runner, Seq2SeqRunner)
    for text in TEXTS[:2]:
        reference = engine.generate(text, max_new_tokens=MAX_NEW, use_draft=False)
        assert reference.token_ids == list(plain("t5", tuple(engine.encode(text))))
        assert reference.token_ids[0] != 0  # the decoder start token is not part of the output
        for k in (3, "auto"):  # auto: the controller's costs are timed over a stand-in source first
            spec = engine.generate(text, max_new_tokens=MAX_NEW, num_speculative_tokens=k)
            assert spec.token_ids == reference.token_ids and spec.text == reference.text
            assert spec.stats.drafted > 0 or k == "auto"  # auto may find drafting too dear for these models
        stairs = engine.generate(text, max_new_tokens=MAX_NEW, num_speculative_tokens=3, verify="stairs")
        assert stairs.token_ids == reference.token_ids and stairs.stats.drafted > 0


def test_engine_streams_are_encoded_when_they_start(dirs):
    # A stream created before another one still decodes its own prompt: the encoders run at its first step.
    engine = Engine.load(dirs["target"], draft=dirs["draft"])
    first = engine.stream(TEXTS[0], max_new_tokens=12, num_speculative_tokens=3)
    second = engine.stream(TEXTS[1], max_new_tokens=12, num_speculative_tokens=3)
    assert engine.generate_from(first).token_ids == list(plain("t5", tuple(SOURCES[0]), 12))
    assert engine.generate_from(second).token_ids == list(plain("t5", tuple(SOURCES[1]), 12))


def test_prompt_lookup_with_a_seq2seq_target(dirs):
    # lookup (alone or before the draft model) looks up in the decoder's own output; still exact
    for draft in ("lookup", f"lookup+{dirs['draft']}"):
        engine = Engine.load(dirs["target"], draft=draft)
        out = engine.generate(TEXTS[2], max_new_tokens=MAX_NEW, num_speculative_tokens=4)
        assert out.token_ids == list(plain("t5", tuple(SOURCES[2])))


@pytest.mark.parametrize("target, draft, message", [
    ("target", "llama", "is an encoder-decoder model but draft"),
    ("llama", "target", "is an encoder-decoder model but target"),
    ("target", "other-vocab", "must share its tokenizer"),
])
def test_mixed_pairs_are_refused(dirs, target, draft, message):
    with pytest.raises(IncompatibleDraftError, match=message):
        Engine.load(dirs[target], draft=dirs[draft])


def test_other_draft_modes_and_int8_are_refused(dirs):
    from specdec.runtime.loading import load_hf

    engine = Engine.load(dirs["target"], draft=dirs["draft"])
    with pytest.raises(SpecdecError, match="draft mode 'text'"):
        engine.generate(TEXTS[0], max_new_tokens=4, num_speculative_tokens=2, draft_mode="text")
    with pytest.raises(SpecdecError, match="int8 is for decoder-only"):
        load_hf(dirs["target"], dtype="int8")


def test_cli_generates_with_seq2seq_directories(dirs):
    from specdec.cli import app

    cli = CliRunner()
    common = ["def fibonacci(n):", "--target", dirs["target"], "--max-new-tokens", "12"]
    streamed = cli.invoke(app, ["generate", *common, "--draft", dirs["draft"], "-k", "3"])
    assert streamed.exit_code == 0, streamed.output
    assert "tokens in" in streamed.output
    spec = json.loads(cli.invoke(app, ["generate", *common, "--draft", dirs["draft"], "-k", "3", "--json"]).stdout)
    base = json.loads(cli.invoke(app, ["generate", *common, "--draft", "none", "--json"]).stdout)
    assert spec["token_ids"] == base["token_ids"] == list(plain("t5", tuple(SOURCES[0]), 12))
    mixed = cli.invoke(app, ["generate", *common, "--draft", dirs["llama"]])
    assert mixed.exit_code == 2 and "Traceback" not in mixed.output
    assert "is an encoder-decoder model but draft" in mixed.output
