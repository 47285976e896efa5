"""Grammars and matchers (specdec.constrain): walks of random logits through every schema of schemas.json give
JSON that validates; the mask never allows a padding id or an early EOS; rollback returns to the same state;
forced tokens are the grammar's fixed text; bad schemas and grammars are one-line SpecdecErrors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from specdec.constrain import Grammar, Matcher
from specdec.errors import SpecdecError
from specdec.zoo import CONVERTED
from tests.conftest import USER_HOME
from tests.tiny import tiny_tokenizer

SCHEMAS = json.loads((Path(__file__).parent / "schemas.json").read_text())
PADDED = 320  # the model's logits: more than the tiny tokenizer's 300 tokens
MAX_TOKENS = 800
# the zoo's Qwen2.5 tokenizer, where the user's model cache has it (converted from the GGUF: 151,936 tokens)
QWEN = USER_HOME / CONVERTED / "qwen2.5-coder-1.5b" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def closing_bias(tok) -> torch.Tensor:
    """[PADDED] a bonus for EOS and for the tokens that end a string, object or array, so that random walks end
    (plain random logits would write strings of hundreds of tokens)."""
    bias = torch.zeros(PADDED)
    for i in range(len(tok)):
        end = tok.decode([i]).rstrip()[-1:]
        bias[i] = {'"': 1.5, "}": 1.5, "]": 0.5}.get(end, 0.0)  # arrays end less eagerly: some get items
    bias[tok.eos_token_id] = 4.0
    return bias


def walk(matcher: Matcher, tok, seed: int, bias: torch.Tensor | None = None) -> list[int]:
    """Greedy decoding of seeded random logits under `matcher` until EOS; checks the mask at every step."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    eos = tok.eos_token_id
    while len(out) < MAX_TOKENS:
        allowed = matcher.allowed()  # [PADDED] bool
        assert allowed.shape == (PADDED,) and allowed.dtype == torch.bool
        assert not allowed[len(tok):].any(), "an id past the tokenizer's is allowed"
        assert allowed.any()
        assert bool(allowed[eos]) == matcher.accepting(), "EOS allowed exactly where the output is complete"
        forced = matcher.forced()
        assert matcher.valid_prefix(forced) == len(forced)
        if forced:  # a forced token is the only one the mask allows: a draft no target can reject
            assert allowed.nonzero().flatten().tolist() == forced[:1]
        logits = torch.randn(PADDED, generator=gen) + (0 if bias is None else bias)  # [PADDED]
        pick = int(matcher.mask_logits(logits).argmax())
        assert allowed[pick]
        assert matcher.consume([pick])
        out.append(pick)
        if pick == eos:
            assert matcher.done() and matcher.valid_prefix([eos]) == 0
            return out
    raise AssertionError(f"no EOS after {MAX_TOKENS} tokens: {tok.decode(out)!r}")


def test_the_schema_set_is_large_and_valid():
    assert len(SCHEMAS) >= 20 and len({s["name"] for s in SCHEMAS}) == len(SCHEMAS)
    for entry in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(entry["schema"])


@pytest.mark.parametrize("entry", SCHEMAS, ids=[s["name"] for s in SCHEMAS])
def test_random_walks_give_json_that_validates(entry, tok):
    grammar = Grammar.from_json_schema(entry["schema"], tok, vocab_size=PADDED)
    bias = closing_bias(tok)
    texts = set()
    for seed in range(4):
        out = walk(grammar.matcher(), tok, seed, bias)
        text = tok.decode(out[:-1])
        jsonschema.validate(json.loads(text), entry["schema"])
        texts.add(text)
    assert len(texts) > 1, f"the walks should differ (seeded logits): {texts}"


def test_json_object_gives_any_object(tok):
    grammar = Grammar.json_object(tok, vocab_size=PADDED)
    bias = closing_bias(tok)
    for seed in range(3):
        out = walk(grammar.matcher(), tok, seed, bias)
        assert isinstance(json.loads(tok.decode(out[:-1])), dict)


@pytest.mark.parametrize("make, text, check", [
    (Grammar.regex, r"[a-c]{2,4}-[0-9]+", lambda s: re.fullmatch(r"[a-c]{2,4}-[0-9]+", s)),
    (Grammar.lark, 'start: "x" ("ab" | "cd")+ "!"', lambda s: re.fullmatch(r"x(ab|cd)+!", s)),
    (Grammar.gbnf, 'root ::= "n=" [0-9] [0-9]? ";"', lambda s: re.fullmatch(r"n=[0-9][0-9]?;", s)),
], ids=["regex", "lark", "gbnf"])
def test_regex_lark_and_gbnf_walks_match(make, text, check, tok):
    grammar = make(text, tok, vocab_size=PADDED)
    for seed in range(3):
        out = walk(grammar.matcher(), tok, seed)
        assert check(tok.decode(out[:-1])), tok.decode(out)


def sample_tokens(tok) -> tuple[Grammar, list[int]]:
    entry = next(s for s in SCHEMAS if s["name"] == "order")
    grammar = Grammar.from_json_schema(entry["schema"], tok, vocab_size=PADDED)
    return grammar, walk(grammar.matcher(), tok, 7, closing_bias(tok))


def state(m: Matcher) -> tuple:
    return (m.allowed().tolist(), m.forced(), m.accepting(), m.done(), m.consumed)


def test_rollback_of_j_after_k_is_the_state_after_k_minus_j(tok):
    grammar, tokens = sample_tokens(tok)
    assert len(tokens) > 30
    for k in (1, 5, 17, len(tokens) - 1, len(tokens)):  # the last: EOS consumed, then rolled back
        for j in sorted({0, 1, 3, k // 2, k} & set(range(k + 1))):
            rolled = grammar.matcher()
            assert rolled.consume(tokens[:k])
            rolled.rollback(j)
            fresh = grammar.matcher()
            assert fresh.consume(tokens[:k - j])
            assert state(rolled) == state(fresh), (k, j)
            assert rolled.consume(tokens[k - j:]) and rolled.done()  # and it goes on to the same end
    m = grammar.matcher()
    m.consume(tokens[:3])
    with pytest.raises(ValueError):
        m.rollback(4)


def test_the_mask_and_the_draft_check_agree_on_every_token(tok):
    grammar, tokens = sample_tokens(tok)
    m = grammar.matcher()
    for k in range(0, len(tokens), 7):  # every 7th position of the output, its end (EOS allowed) among them
        m.rollback(m.consumed)
        assert m.consume(tokens[:k])
        allowed = m.allowed().tolist()
        assert allowed == [m.valid_prefix([t]) == 1 for t in range(PADDED)], k


def test_draft_masks_are_the_masks_at_each_draft_position(tok):
    grammar, tokens = sample_tokens(tok)
    m = grammar.matcher()
    assert m.consume(tokens[:20])
    bad = next(t for t in range(len(tok)) if not m.allowed()[t])
    for draft, n in ((tokens[20:26], 6), (tokens[20:23] + [bad] + tokens[23:25], 3), ([bad], 0), ([], 0),
                     (tokens[20:], len(tokens) - 20)):  # the last runs through EOS: no token after it
        valid, masks = m.draft_masks(draft)
        assert valid == n and masks.shape == (n + 1, PADDED) and m.consumed == 20
        walker = grammar.matcher()
        assert walker.consume(tokens[:20])
        for i in range(n + 1):
            assert torch.equal(masks[i], walker.allowed()), i
            if i < n:
                assert walker.consume([draft[i]])


def test_a_refused_token_consumes_nothing(tok):
    grammar, tokens = sample_tokens(tok)
    m = grammar.matcher()
    assert m.consume(tokens[:10])
    before = state(m)
    bad = next(t for t in range(len(tok)) if not m.allowed()[t])
    assert m.valid_prefix(tokens[10:14] + [bad]) == 4
    assert not m.consume(tokens[10:14] + [bad])  # a valid run then a bad token: none of them
    assert not m.consume([PADDED - 1])  # a padding id
    assert state(m) == before


def test_eos_only_where_the_output_is_complete(tok):
    eos = tok.eos_token_id
    m = Grammar.from_json_schema({"type": "integer"}, tok, vocab_size=PADDED).matcher()
    assert not m.accepting() and m.valid_prefix([eos]) == 0 and not m.consume([eos])
    digits = tok.encode("12", add_special_tokens=False)
    assert m.valid_prefix(digits + [eos, digits[0]]) == len(digits) + 1  # nothing after EOS
    assert m.consume(digits) and m.accepting() and not m.done()  # "12" may go on ("123") or end
    assert m.consume([eos]) and m.done() and not m.accepting() and not m.consume(digits[:1])
    m.rollback(1)
    assert m.accepting() and not m.done()

    closed = Grammar.from_json_schema({"enum": ["yes"]}, tok, vocab_size=PADDED).matcher()
    assert closed.consume(tok.encode('"yes"', add_special_tokens=False))
    assert closed.done() and closed.accepting()  # nothing but EOS may follow: it must be accepted
    assert closed.allowed().nonzero().flatten().tolist() == [eos]
    assert closed.valid_prefix([eos]) == 1 and closed.consume([eos])


def test_forced_tokens_are_the_grammars_fixed_text(tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    m = Grammar.from_json_schema(schema, tok, vocab_size=PADDED).matcher()
    forced = m.forced()
    text = tok.decode(forced)
    assert '{"name": "'.startswith(text) and text.startswith('{"name'), text  # the key's tokens, and more
    assert m.valid_prefix(forced) == len(forced)
    assert m.consume(tok.encode('{"name": "', add_special_tokens=False))
    assert m.forced() == []  # inside a free string: nothing is forced

    e = Grammar.from_json_schema({"type": "object", "properties": {"unit": {"enum": ["fahrenheit"]}},
                                  "required": ["unit"], "additionalProperties": False}, tok, vocab_size=PADDED)
    two = Grammar.from_json_schema({"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                                    "required": ["unit"], "additionalProperties": False}, tok, vocab_size=PADDED)
    whole = tok.decode(e.matcher().forced())
    assert whole.startswith('{"unit": "fahrenhei'), whole  # a one-value enum is forced through its value
    assert tok.decode(two.matcher().forced()) in ('{"unit": ', '{"unit": "')  # a choice: forced up to it


def test_grammars_are_compiled_once_and_cached(tok):
    a = Grammar.from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, tok, vocab_size=PADDED)
    b = Grammar.from_json_schema({"properties": {"a": {"type": "integer"}}, "type": "object"}, tok, vocab_size=PADDED)
    assert a is b
    assert Grammar.from_json_schema(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}), tok,
                                    vocab_size=PADDED) is a
    assert Grammar.from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, tok) is not a
    one, two = a.matcher(), a.matcher()
    assert one.consume(tok.encode('{"a": 1', add_special_tokens=False))
    assert two.consumed == 0 and not two.allowed()[tok.encode("}", add_special_tokens=False)[0]]  # own states


@pytest.mark.parametrize("make, text", [
    (Grammar.from_json_schema, {"type": "strnig"}),
    (Grammar.from_json_schema, {"type": "string", "pattern": "(("}),
    (Grammar.from_json_schema, '{"type": '),
    (Grammar.from_json_schema, "[1, 2]"),
    (Grammar.from_json_schema, {"type": "object", "if": {"type": "object"}}),  # strict: a keyword it cannot enforce
    (Grammar.regex, "(("),
    (Grammar.lark, "start: undefined_rule"),
    (Grammar.gbnf, "root ::= ("),
    (Grammar.lark, "start: start"),  # compiles, but its language is empty: its first mask fails
    (Grammar.gbnf, "root ::= root"),
])
def test_bad_schemas_and_grammars_are_one_line_errors(make, text, tok):
    with pytest.raises(SpecdecError) as err:
        make(text, tok)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_not_strict_ignores_what_it_cannot_enforce(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False, "if": {"type": "object"}}
    m = Grammar.from_json_schema(schema, tok, strict=False, vocab_size=PADDED).matcher()
    assert m.consume(tok.encode('{"a": 3}', add_special_tokens=False))


def test_specdecs_own_tokenizer_gives_the_same_masks(tmp_path, tok):
    from specdec.tokenizer import LeanTokenizer
    from specdec.vocab import fast_tokenizer

    folder = tmp_path / "tok"
    tok.save_pretrained(folder)
    lean = fast_tokenizer(folder)
    assert isinstance(lean, LeanTokenizer)
    schema = next(s for s in SCHEMAS if s["name"] == "tool_call")["schema"]
    a = Grammar.from_json_schema(schema, tok, vocab_size=PADDED).matcher()
    b = Grammar.from_json_schema(schema, lean, vocab_size=PADDED).matcher()
    assert a.grammar is not b.grammar  # two tokenizer objects, two compilations
    for t in walk(Grammar.from_json_schema(schema, tok, vocab_size=PADDED).matcher(), tok, 3, closing_bias(tok)):
        assert torch.equal(a.allowed(), b.allowed()) and a.forced() == b.forced()
        assert a.consume([t]) and b.consume([t])


def test_vocabularies_the_grammar_cannot_serve(tok):
    with pytest.raises(SpecdecError, match="fewer than its tokenizer"):
        Grammar.json_object(tok, vocab_size=len(tok) - 1)
    with pytest.raises(SpecdecError, match="end-of-sequence"):
        Grammar.json_object(tok, eos_token_ids=[])
    with pytest.raises(SpecdecError, match="fast"):
        Grammar.json_object(object())


@pytest.mark.skipif(not QWEN.exists(), reason="the zoo's Qwen2.5 tokenizer is not in the model cache")
def test_qwen_vocabulary_with_its_padded_logits():
    from tokenizers import Tokenizer

    qwen = Tokenizer.from_file(str(QWEN))
    im_end, end_of_text = qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")
    grammar = Grammar.from_json_schema(SCHEMAS[3]["schema"], qwen, vocab_size=151936,
                                       eos_token_ids=[im_end, end_of_text])
    m = grammar.matcher()
    allowed = m.allowed()  # [151936]
    assert allowed.shape == (151936,) and not allowed[qwen.get_vocab_size(with_added_tokens=True):].any()
    forced = m.forced()
    assert qwen.decode(forced).startswith('{"status')
    walker = grammar.matcher()
    for t in forced:  # each forced token is the only one allowed where it stands
        assert walker.allowed().nonzero().flatten().tolist() == [t] and walker.consume([t])
    assert m.consume(qwen.encode('{"status": "pending", "priority": "low"}', add_special_tokens=False).ids)
    assert m.done() and m.allowed().nonzero().flatten().tolist() == sorted([im_end, end_of_text])
    logits = torch.zeros(151936)
    assert m.mask_logits(logits).isfinite().sum() == 2

    # the GGUF's padding rows ([PAD151665]...) are tokens of this tokenizer, but never text of the output
    pads = [i for text, i in qwen.get_vocab().items() if text.startswith("[PAD")]
    assert pads and max(pads) == 151935
    free = Grammar.from_json_schema(SCHEMAS[0]["schema"], qwen, vocab_size=151936, eos_token_ids=[im_end]).matcher()
    assert free.consume(qwen.encode('{"name": "', add_special_tokens=False).ids)
    allowed = free.allowed()
    assert allowed.sum() > 100_000 and not allowed[pads].any() and free.valid_prefix(pads[:1]) == 0
