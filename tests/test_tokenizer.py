"""The lean tokenizer (specdec.tokenizer): it answers as the transformers tokenizer it stands for -- ids, text,
chat turns, special ids -- on the zoo's real tokenizers and on tiny ones (WordPiece with clean-up, templates
with every extra of transformers' environment); a snapshot that would differ is never used; a damaged one is
taken again with one line; a warm load imports no transformers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdec.bench.prompts import load_prompts
from specdec.tokenizer import LeanTokenizer, lean_tokenizer
from specdec.vocab import fast_tokenizer, same_vocabulary, saved_tokenizer, tokenizer_key
from tests.tiny import save_tiny

REAL = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")


def random_texts(seed: int, count: int) -> list[str]:
    """Texts of random code points from several scripts, spaces, punctuation and emoji."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x0A, 0x0A), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x3040, 0x30FF),
              (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x600, 0x6FF)]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 40)):
            lo, hi = rng.choice(ranges)
            parts.append(chr(rng.randint(lo, hi)) if rng.random() < 0.7 else rng.choice(["  ", " . ", "\n\t", "'s"]))
        out.append("".join(parts))
    return out


def assert_same(lean: LeanTokenizer, hf, texts: list[str], seed: int = 0) -> None:
    """`lean` encodes `texts` and decodes them, and random id runs, exactly as `hf` does."""
    assert isinstance(lean, LeanTokenizer)
    for text in texts:
        for special in (True, False):
            assert lean(text, add_special_tokens=special) == dict(hf(text, add_special_tokens=special))
    rng = random.Random(seed)
    vocab = len(hf)
    specials = [i for i in (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) if i is not None]
    for _ in range(200):
        ids = [rng.randrange(vocab) if rng.random() < 0.9 else rng.choice(specials or [0]) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            for clean in (None, False):
                assert lean.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == hf.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
    assert (lean.eos_token_id, lean.bos_token_id, lean.pad_token_id) == (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id)
    assert lean.get_vocab() == hf.get_vocab() and lean.chat_template == hf.chat_template and len(lean) == len(hf)
    assert lean.vocab_size == hf.vocab_size
    some = hf("hello world, 12")["input_ids"]
    assert lean.decode(torch.tensor(some)) == hf.decode(torch.tensor(some)) and lean.decode(some[0]) == hf.decode(some[0])


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_the_zoo_tokenizers_answer_as_transformers(name):
    from specdec import zoo
    from tests.conftest import user_home

    with user_home():
        folder = zoo.hf_dir(name)
    hf = AutoTokenizer.from_pretrained(folder)
    lean = fast_tokenizer(folder)  # a snapshot taken in this session's temporary home
    prompts = load_prompts()
    texts = [p.plain_text for p in prompts] + random_texts(1, 150)
    assert_same(lean, hf, texts)
    if hf.chat_template is None:
        return
    for p in prompts:
        for opened in (True, False):
            messages = [{"role": r, "content": c} for r, c in p.messages]
            want = hf.apply_chat_template(messages, add_generation_prompt=opened, tokenize=True)
            assert lean.apply_chat_template(messages, add_generation_prompt=opened) == dict(want)
            assert lean.apply_chat_template(messages, add_generation_prompt=opened, tokenize=False) == \
                hf.apply_chat_template(messages, add_generation_prompt=opened, tokenize=False)


def wordpiece_folder(tmp_path, template: str | None = None) -> str:
    """A saved WordPiece tokenizer that cleans up tokenization spaces (as BERT's do), with `template`."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", ".", ",", "it",
                                          "'", "s", "n", "t", "is", "?", "!", "##s", "a", "b"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", eos_token="[SEP]", clean_up_tokenization_spaces=True)
    if template is not None:
        tok.chat_template = template
    folder = tmp_path / "wordpiece"
    tok.save_pretrained(folder)
    return str(folder)


def test_a_wordpiece_tokenizer_cleans_up_as_transformers(tmp_path):
    folder = wordpiece_folder(tmp_path)
    hf, lean = AutoTokenizer.from_pretrained(folder), fast_tokenizer(folder)
    assert lean.cleans_up
    texts = ["hello , world . it ' s a b !", "hellos world ?", "a n ' t", ""]
    assert_same(lean, hf, texts)
    ids = hf("hello , world . it 's")["input_ids"]
    assert lean.decode(ids, clean_up_tokenization_spaces=True) == hf.decode(ids, clean_up_tokenization_spaces=True)
    assert lean.decode(ids) != lean.decode(ids, clean_up_tokenization_spaces=False)  # the clean-up did something


TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.n = ns.n + 1 %}{% endif %}"
    "{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{% if loop.index > 9 %}{% break %}{% endif %}"
    "[{{ m.role }}] {% generation %}{{ m.content | tojson }}{% endgeneration %} {{ dict(a=1) | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {{ ns.n }}{% endif %}{{ eos_token }}"
)


def test_a_template_with_every_extra_renders_as_transformers(tmp_path):
    folder = wordpiece_folder(tmp_path, TEMPLATE)
    hf, lean = AutoTokenizer.from_pretrained(folder), fast_tokenizer(folder)
    assert isinstance(lean, LeanTokenizer) and lean._chat_ok
    messages = [{"role": "system", "content": "hello"}, {"role": "user", "content": "it's a \"b\" <é>", "name": None}]
    for opened in (True, False):
        assert lean.apply_chat_template(messages, add_generation_prompt=opened, tokenize=False) == \
            hf.apply_chat_template(messages, add_generation_prompt=opened, tokenize=False)
        assert lean.apply_chat_template(messages, add_generation_prompt=opened) == \
            dict(hf.apply_chat_template(messages, add_generation_prompt=opened))
    with pytest.raises(Exception, match="no tools"):
        lean.apply_chat_template([{"role": "tool", "content": "x"}])


def test_what_the_lean_tokenizer_lacks_the_transformers_one_answers(tmp_path):
    folder = save_tiny(tmp_path / "model", "llama", seed=0)
    lean = fast_tokenizer(folder)
    assert isinstance(lean, LeanTokenizer) and lean._full is not None  # the first load took the snapshot
    again = fast_tokenizer(folder)
    assert isinstance(again, LeanTokenizer) and again._full is None  # from the snapshot: nothing else loaded
    ids = again("def add(a, b)")["input_ids"]
    assert again.convert_ids_to_tokens(ids) == lean.full().convert_ids_to_tokens(ids)  # forwarded, loaded once
    assert again._full is not None and same_vocabulary(again, lean) and same_vocabulary(again, again.full())


def test_a_snapshot_that_would_differ_is_not_used(tmp_path, monkeypatch):
    folder = save_tiny(tmp_path / "model", "llama", seed=0)
    monkeypatch.setattr(LeanTokenizer, "decode", lambda self, ids, *a, **k: "different")  # a lean decode that differs
    cache = tmp_path / "lean"
    first = lean_tokenizer(tokenizer_key(folder), cache, lambda: saved_tokenizer(folder))
    assert not isinstance(first, LeanTokenizer)  # the transformers tokenizer itself
    assert json.loads((cache / f"{tokenizer_key(folder)}.json").read_text()) == {"format": 1, "lean": False}
    assert not isinstance(lean_tokenizer(tokenizer_key(folder), cache, lambda: saved_tokenizer(folder)), LeanTokenizer)


def test_a_damaged_snapshot_is_taken_again_with_one_line(tmp_path, capsys):
    folder = save_tiny(tmp_path / "model", "llama", seed=0)
    capsys.readouterr()
    key, cache = tokenizer_key(folder), tmp_path / "lean"
    first = lean_tokenizer(key, cache, lambda: saved_tokenizer(folder))
    meta = cache / f"{key}.json"
    meta.write_text(meta.read_text()[:40])  # truncated
    again = lean_tokenizer(key, cache, lambda: saved_tokenizer(folder))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not be read" in err[0] and "taking it again" in err[0]
    assert isinstance(again, LeanTokenizer) and again("a b c")["input_ids"] == first("a b c")["input_ids"]
    assert json.loads(meta.read_text())["format"] == 1  # whole again


def test_a_warm_load_imports_no_transformers(tmp_path):
    folder = save_tiny(tmp_path / "model", "llama", seed=0)
    fast_tokenizer(folder)  # takes the snapshot (this session's home)
    code = ("import sys; from specdec.vocab import fast_tokenizer; t = fast_tokenizer(sys.argv[1]); "
            "ids = t('hello there')['input_ids']; t.decode(ids); "
            "print(type(t).__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, check=True,
                         env=dict(os.environ)).stdout.split()
    assert out == ["LeanTokenizer", "[]"]
