"""Tokenizers (specdec.vocab): a saved tokenizer loads through a cached pickle, the same tokenizer; a cache that
cannot be read is rebuilt with one line saying so; another tokenizer never gets the cached one."""

from __future__ import annotations

import pickle
from pathlib import Path

from specdec.vocab import saved_tokenizer, tokenizer_key
from tests.tiny import save_tiny

TEXT = "def add(a, b): return a + b"


def test_a_saved_tokenizer_comes_back_from_its_cached_pickle(tmp_path, capsys):
    folder = save_tiny(tmp_path / "model", "llama", seed=0)
    capsys.readouterr()  # saving the model's progress bar
    cache = tmp_path / "cache"
    first = saved_tokenizer(folder, cache)
    [kept] = list(cache.glob("*.pkl"))
    assert kept.stem == tokenizer_key(folder)
    second = saved_tokenizer(folder, cache)
    assert second is not first  # unpickled, not a shared object
    assert second(TEXT)["input_ids"] == first(TEXT)["input_ids"] and second.get_vocab() == first.get_vocab()
    assert second.eos_token_id == first.eos_token_id and capsys.readouterr().err == ""

    kept.write_bytes(kept.read_bytes()[:100])  # truncated
    third = saved_tokenizer(folder, cache)
    assert third(TEXT)["input_ids"] == first(TEXT)["input_ids"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not be read" in err[0] and "rebuilding" in err[0]
    assert pickle.loads(kept.read_bytes()).get_vocab() == first.get_vocab()  # rebuilt


def test_another_tokenizer_has_another_key(tmp_path):
    one = Path(save_tiny(tmp_path / "one", "llama", seed=0))
    other = save_tiny(tmp_path / "other", "qwen2", seed=2, variant=1)
    assert tokenizer_key(one) != tokenizer_key(other)
    (one / "tokenizer_config.json").write_text((one / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1))
    changed = tokenizer_key(one)
    assert changed is not None and changed != tokenizer_key(save_tiny(tmp_path / "again", "llama", seed=0))
    assert tokenizer_key(tmp_path) is None  # no tokenizer.json: loaded as it is, uncached
