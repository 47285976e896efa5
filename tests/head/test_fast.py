"""The head's inference form (specdec.head.fast) and its cost report (specdec.runtime.head_cost): fp32 it is the trained
head's numbers, int8 it proposes nearly what the fp32 head does, through the loop the output is plain greedy's
(int8 target: bitwise), and where the kernels do not run it falls back to fp32 and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.algorithm.loop import StopCondition, run
from specdec.algorithm.sampling import SamplingParams
from specdec.algorithm.verify import make_verifier
from specdec.backends.hf import HFRunner
from specdec.errors import SpecdecError
from specdec.head import fast
from specdec.head.drafter import HeadDrafter
from specdec.head.fast import FastHead, for_drafting
from specdec.head.model import DraftHead, HeadCache
from specdec.head.store import TrainResult, save, target_identity
from specdec.native.lean import LeanRunner
from specdec.native.quant import quantize_model
from specdec.runtime.head_cost import head_cost, head_for_profile, profile_head, split_head_spec
from tests.head.conftest import target_pass
from tests.tiny import assert_near_tie_parting, tiny_model

STOP = StopCondition(max_new_tokens=40)


def outputs(head: DraftHead | FastHead, target: torch.nn.Module,
            stream: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a whole stream, teacher-forced in one forward: (predicted features [T, H], logits [T, N])."""
    ids = torch.tensor([stream])  # [1, T + 1]
    features = target_pass(target, ids)[0][0, :-1]  # [T, H]
    if isinstance(head, FastHead):
        return head.forward(features, ids[0, 1:], HeadCache())
    with torch.no_grad():
        predicted, logits = head(features[None], ids[:, 1:])
    return predicted[0], logits[0]


def test_fp32_form_is_the_trained_heads_numbers(target: torch.nn.Module, text: list[list[int]],
                                                trained: TrainResult) -> None:
    head = FastHead(trained.head, "fp32")
    assert head.describe() == "fp32"
    for stream in text[:3]:
        (p1, l1), (p2, l2) = outputs(trained.head, target, stream), outputs(head, target, stream)
        assert torch.allclose(p1, p2, atol=1e-4) and torch.allclose(l1, l2, atol=1e-4)
        features = target_pass(target, torch.tensor([stream]))[0][0]  # [T + 1, H]
        for p in (1, 7, 20):
            tokens = torch.tensor(stream[1: p + 1])
            assert (head.draft(HeadCache(), features[:p], tokens, 4)
                    == trained.head.draft(HeadCache(), features[:p], tokens, 4))


@pytest.mark.parametrize("dtype, least", [("int8", 0.9), ("int4", 0.5)])
def test_quantized_forms_propose_what_the_fp32_head_does(dtype: str, least: float, target: torch.nn.Module,
                                                        text: list[list[int]], trained: TrainResult) -> None:
    """The greedy draft token at every position of the text (a 32-wide tiny head: int8's rounding weighs more
    than on a real one's 1536 columns; int4 is the coarser approximation)."""
    head = FastHead(trained.head, dtype)
    assert head.describe() == f"{dtype} (specdec kernel)"
    same = total = 0
    for stream in text:
        reference, quantized = outputs(trained.head, target, stream)[1], outputs(head, target, stream)[1]
        same += int((reference.argmax(-1) == quantized.argmax(-1)).sum())
        total += len(reference)
    assert same / total >= least, f"{same} of {total}"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_through_the_loop_is_plain_greedy(k: int, target: torch.nn.Module, text: list[list[int]],
                                                 trained: TrainResult) -> None:
    head = for_drafting(trained.head)
    assert for_drafting(head) is head
    lean = LeanRunner(quantize_model(tiny_model("llama", seed=0)))  # the head's target in int8: bitwise
    hf = HFRunner(target)
    accepted = 0
    for prompt in (text[1][:5], text[3][:9], [1, 50, 7, 88, 13]):
        out = run(lean, prompt, STOP, HeadDrafter(head, lean), k)
        assert out.token_ids == run(lean, prompt, STOP).token_ids
        accepted += out.stats.accepted
        out = run(hf, prompt, STOP, HeadDrafter(head, hf), k)
        assert_near_tie_parting(target, prompt, out.token_ids, run(hf, prompt, STOP).token_ids)
    assert accepted > 0


def test_samples_through_the_loop(target: torch.nn.Module, text: list[list[int]], trained: TrainResult) -> None:
    """Sampling: the loop runs with the int8 head drafting, and a proposal's q is the head's warped distribution, on
    the draft vocabulary.  The proposal is made from a state set up here (the prompt's prefill, a one-row forward
    last), not from whatever the sampled run left behind: which tokens a sampled run draws, and so whether its last
    target forward was a verification the head cannot draft after, turns on the CPU's float rounding."""
    runner, params = HFRunner(target), SamplingParams(temperature=0.8, top_k=20, seed=0)
    drafter = HeadDrafter(FastHead(trained.head, "int8"), runner, params)
    prompt = text[1][:5]
    out = run(runner, prompt, STOP, drafter, 3, verifier=make_verifier(params))
    assert len(out.token_ids) == STOP.max_new_tokens and out.stats.drafted > 0
    runner.reset()
    runner.forward(prompt[:-1], last_n=1)  # the loop's prefill: the target caches all but the pending token
    draft = HeadDrafter(FastHead(trained.head, "int8"), runner, params).propose(prompt, 2)
    assert len(draft.tokens) == 2 and draft.q is not None and draft.q.shape == (2, runner.vocab_size)
    assert torch.allclose(draft.q.sum(-1), torch.ones(2), atol=1e-5)
    assert all(t in trained.head.vocab for t in draft.tokens)
    outside = torch.ones(runner.vocab_size, dtype=torch.bool)
    outside[trained.head.vocab] = False
    assert float(draft.q[:, outside].abs().sum()) == 0.0  # no mass off the draft vocabulary


def test_falls_back_to_fp32_where_the_kernels_do_not_run(monkeypatch: pytest.MonkeyPatch, trained: TrainResult) -> None:
    monkeypatch.setattr(fast, "kernel_path", lambda: (None, "no C compiler"))
    for dtype in ("auto", "int8", "int4"):
        head = FastHead(trained.head, dtype)
        assert head.dtype == "fp32" and head.describe() == "fp32: no C compiler"
    monkeypatch.setattr(fast, "kernel_path", lambda: ("c", "no AVX2"))
    assert FastHead(trained.head).describe() == "fp32: no AVX2"  # auto: int8 only where it is fast
    assert FastHead(trained.head, "int8").dtype == "int8"  # asked for: the portable kernel, the same numbers
    with pytest.raises(SpecdecError, match="runs in"):
        FastHead(trained.head, "bf16")


def test_head_cost_reports_the_ratio_to_a_target_step(target: torch.nn.Module, trained: TrainResult) -> None:
    head = FastHead(trained.head, "int8")
    cost = head_cost(head, HFRunner(target), tokens=3, prefix=8, repeats=1)
    assert cost["head"] == "int8 (specdec kernel)" and cost["draft_vocab"] == len(trained.head.vocab)
    assert cost["ms_per_token"] > 0 and cost["target_step_ms"] > 0
    assert cost["ratio"] == pytest.approx(cost["ms_per_token"] / cost["target_step_ms"], rel=1e-2)
    assert head_cost(trained.head, HFRunner(target), 2, 4, 1, target_ms=10.0)["head"] == "fp32 (transformers layer)"


def test_the_profiled_head_is_found_by_spec_or_for_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              target: torch.nn.Module, trained: TrainResult) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    assert split_head_spec("head") == (None, "") and split_head_spec("lookup+head:/x") == (None, "/x")
    assert split_head_spec("lookup+tiny") == ("lookup+tiny", None) and split_head_spec(None) == (None, None)
    runner = HFRunner(target)
    assert profile_head(None, "tiny", runner, 8, 1) is None  # none trained for it: nothing to report
    with pytest.raises(SpecdecError, match="no draft head for tiny: train one"):
        profile_head("head", "tiny", runner, 8, 1)
    directory = save(trained.head, tmp_path / "h", target_identity(target, "tiny"))
    found = head_for_profile(f"head:{directory}", "tiny", target)
    assert found is not None and isinstance(found[0], FastHead) and found[1] == directory
    save(trained.head, tmp_path / "home" / "drafters" / "tiny-head", target_identity(target, "tiny"))
    report = profile_head("none-such-draft", "tiny", runner, 8, 1, target_ms=5.0)
    assert report is not None and report["directory"].endswith("tiny-head") and report["ms_per_token"] > 0
    with pytest.raises(SpecdecError, match="trained for another target"):
        head_for_profile(f"head:{directory}", "tiny", tiny_model("llama", seed=1))


def test_profile_prints_the_heads_cost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: TrainResult) -> None:
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from specdec.cli import app
    from tests.tiny import save_tiny

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    folder = save_tiny(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(folder)
    directory = save(DraftHead(model, torch.arange(16)), tmp_path / "head", target_identity(model, folder))  # untrained
    result = CliRunner().invoke(app, ["profile", "--target", folder, "--draft", f"head:{directory}", "--dtype", "fp32",
                                      "--ks", "1,2", "--prefix", "8", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["head"]
    assert report["ms_per_token"] > 0 and report["ratio"] > 0 and report["directory"] == str(directory)
    table = CliRunner().invoke(app, ["profile", "--target", folder, "--draft", f"head:{directory}", "--dtype", "fp32",
                                     "--ks", "1,2", "--prefix", "8", "--repeats", "1"])
    printed = " ".join(table.output.split())  # rich wraps lines at the terminal's width
    assert table.exit_code == 0 and "ms per drafted token" in printed and "of the target's one-token step" in printed
