"""Quality measures (specdec.bench.quality): perplexity, first divergence, and `specdec quality`."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from specdec.bench.quality import agreement, first_divergence, perplexity, reference_texts
from specdec.cli import app
from tests.tiny import save_tiny
from tests.toy import ToyRunner, random_table


def test_perplexity_is_exp_of_the_mean_negative_log_likelihood():
    table = random_table(6, seed=0)
    runner = ToyRunner(table)
    ids = [1, 4, 2, 2, 5, 0, 3]
    expected = []
    for j in range(1, len(ids)):
        prev = ids[j - 2] if j >= 2 else 6
        expected.append(-torch.log_softmax(table[prev, ids[j - 1]].double(), -1)[ids[j]])
    assert perplexity(runner, ids) == pytest.approx(math.exp(float(torch.stack(expected).mean())), rel=1e-6)
    assert runner.tokens == []  # left empty
    with pytest.raises(ValueError):
        perplexity(runner, [1])


def test_first_divergence_and_agreement():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [1]) == 0
    a = agreement([[1, 2, 3], [5, 6]], [[1, 2, 3], [5, 7]])
    assert a.divergences == [3, 1] and a.mean_first_divergence == 2.0 and a.identical_rate == 0.5


def test_reference_texts_are_fixed_code_and_prose():
    texts = reference_texts()
    assert set(texts) == {"code", "prose"} and "def decode(" in texts["code"] and len(texts["prose"]) > 1500


def test_quality_cli_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    target = save_tiny(tmp_path / "t", "qwen2", seed=0)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nOnce upon a time\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["quality", "--target", target, "--prompts", str(prompts), "-n", "6",
                                      "--no-chat", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["candidate"] == "hf int8" and out["prompts"] == 2 and len(out["first_divergence"]) == 2
    assert 0 <= out["mean_first_divergence"] <= 6 and set(out["perplexity"]) == {"code", "prose"}
    assert all(v > 1 for text in out["perplexity"].values() for v in text.values())
