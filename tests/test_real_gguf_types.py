"""The gguf target on real weights of every block type it multiplies: the zoo's smollm2-135m requantised by
llama.cpp's own quantiser (tests.requant, made once into the real cache's models/derived).

smollm2-135m's hidden size, 576, is not a multiple of 256, so llama.cpp writes the K and IQ4_XS types only where
a row is 1536 wide (ffn_down) and falls back to 32-wide types elsewhere: each file below mixes types, and the
test asserts which it holds (FILES).  Together they cover Q4_0, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS, F16 and BF16 (Q4_1 is the zoo file's own, tests/test_real_gguf.py).  Q2_K blocks are in none: llama.cpp's
Q2_K file type writes this model's ffn_down as Q3_K and Q2_K_S needs an importance matrix, so Q2_K rests on the
kernel's unit tests (tests/native/test_gguf_kernel.py).  For each file:

- it loads on the gguf target (what `--dtype gguf` loads) and greedy speculative decoding gives plain decoding's
  tokens, with the zoo's own smollm2-135m file as the draft model (γ 2 and 4) and with suffix drafts (γ auto);
  the F16 and BF16 files, whose k-row forwards are slow, with the draft model at γ 2 only, on fewer tokens;
- its logits agree with llama.cpp's (llama-cpp-python) on the same file and tokens: the same argmax on at least
  TOP1_SHARE of the positions of two short texts, and where they differ, ours is a near tie in llama.cpp's
  logits (within NEAR_TIE of its largest); the median over positions of |ours - llama.cpp's| / |llama.cpp's|
  (L2 over the vocabulary) within a bound per file.  Seen here: top-1 62..69 of 69 positions, near ties within
  0.71, median relative differences 0.02..0.06 for the quantised files, 0.001 (F16) and 0.006 (BF16): llama.cpp
  computes in another order and precision (an F16 KV cache, fp16 scales for the activations' 8-bit blocks).  A
  block read with a wrong layout fails: IQ4_NL's blocks read as Q4_0's (the same size) put ours 19 logits below
  llama.cpp's largest, BF16 read as F16 23.

Marked `real`; in the fp32-target group (tests/conftest.py) with tests/test_real_gguf.py, whose loaded
smollm2-135m it shares.  Making the files the first time takes about 90 s here (IQ4_XS 74 s: llama.cpp searches
each block's scales; tests/requant.py), in the first test of each.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.native import gguf
from specdec.runtime.engine import Engine
from tests.conftest import real_model_threads, require_llama_cpp
from tests.real_checks import PROMPTS
from tests.requant import requantized_zoo

pytestmark = pytest.mark.real

MODEL = "smollm2-135m"
# llama.cpp file type -> the block types its smollm2-135m file must hold (what the file is here to test)
FILES = {
    "Q2_K": {"Q3_K", "Q4_0"},  # Q3_K in ffn_down, Q4_0 elsewhere
    "Q3_K_M": {"Q4_K", "Q5_0", "Q5_1"},
    "Q5_K_M": {"Q5_K", "Q6_K", "Q5_1", "Q8_0"},
    "IQ4_XS": {"IQ4_XS", "IQ4_NL"},  # IQ4_XS in ffn_down, IQ4_NL elsewhere
    "F16": {"F16"},
    "BF16": {"BF16"},
}
FLOAT_FILES = {"F16", "BF16"}
TEXTS = [  # about 30 tokens each, prose and code
    "The quick brown fox jumps over the lazy dog. Meanwhile, in the kitchen, a pot of soup was slowly coming to"
    " a boil while",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "print(fibonacci(",
]
TOP1_SHARE = 0.85  # of the positions of TEXTS with llama.cpp's argmax
NEAR_TIE = 1.5  # where the argmaxes differ: llama.cpp's logit of ours within this of its largest
MEDIAN_REL = {"quantised": 0.1, "float": 0.015}  # the median relative difference's bound
MAX_NEW = 16


@pytest.fixture(scope="module")
def zoo_model(real_gguf):
    """(runner, tokenizer) of the zoo's own smollm2-135m file (Q4_1): the draft, and every file's tokenizer."""
    return real_gguf(MODEL)


@pytest.fixture(scope="module", params=list(FILES))
def loaded(request):
    """(ftype, path, GGUFRunner) of each file in turn, loaded once for the module's tests of it (a module-scoped
    parameter: pytest runs every test of one file before it loads the next)."""
    path = requantized_zoo(MODEL, request.param)
    with real_model_threads():
        return request.param, path, gguf.load(path, name=f"{MODEL}-{request.param}")


def test_the_file_holds_its_types_and_speculative_is_plain(loaded, zoo_model):
    ftype, path, runner = loaded
    names = {gguf._type_name(t.type_id) for t in gguf.GGUFFile(path).tensors.values() if len(t.shape) > 1}
    assert FILES[ftype] <= names, (ftype, names)
    draft, tokenizer = zoo_model
    # token ids, not text: no chat template, a short prefill (the float files' k-row forwards are slow)
    code, prose = (tokenizer(p, add_special_tokens=False)["input_ids"] for p in (PROMPTS[0], PROMPTS[3]))
    cases = [(code, (draft, tokenizer), {}, 2), (prose, (draft, tokenizer), {}, 4),  # the zoo file, γ 2 and 4
             (code, (), dict(suffix=True), "auto")]  # suffix drafts from the context, γ chosen per step
    if ftype in FLOAT_FILES:  # their k-row forwards are slow (a float kernel): one drafter, fewer tokens
        cases, new = cases[:1], MAX_NEW // 2
    else:
        new = MAX_NEW
    plain_engine = Engine(runner, tokenizer)
    drafted = 0
    with real_model_threads():
        plain = {tuple(p): plain_engine.generate(p, max_new_tokens=new, use_draft=False).token_ids
                 for p in (code, prose)}
        for prompt, drafter, copying, k in cases:
            engine = Engine(runner.clone(), tokenizer, *drafter, **copying)
            result = engine.generate(prompt, max_new_tokens=new, num_speculative_tokens=k)
            assert result.token_ids == plain[tuple(prompt)], (ftype, k, copying)
            drafted += result.stats.drafted
    assert drafted > 0, ftype  # the loop verified drafts, not only plain steps


@pytest.fixture(scope="module")
def llama_cpp_logits():
    """logits(path, texts' tokens) -> llama.cpp's fp32 logits [n, V] of each token list, from the file at `path`
    (loaded once for them all)."""
    llama_cpp = require_llama_cpp()

    def logits(path, token_lists: list[list[int]]) -> list[np.ndarray]:
        model = llama_cpp.Llama(str(path), logits_all=True, n_ctx=128, n_threads=1, verbose=False)
        try:
            out = []
            for tokens in token_lists:
                model.reset()  # each text from an empty cache
                model.eval(tokens)
                out.append(np.array(model.scores[: len(tokens)], dtype=np.float32))  # [n, V]
            return out
        finally:
            model.close()

    return logits


def test_its_logits_agree_with_llama_cpps(loaded, zoo_model, llama_cpp_logits):
    ftype, path, runner = loaded
    _, tokenizer = zoo_model
    token_lists = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    same, positions, rel = 0, 0, []
    for tokens, theirs in zip(token_lists, llama_cpp_logits(path, token_lists)):
        with real_model_threads():
            ours = runner.clone().forward(tokens).numpy()  # [n, V], from an empty cache
        theirs = theirs[:, : ours.shape[1]]  # [n, V]
        picked = ours.argmax(1)  # [n]
        same += int((picked == theirs.argmax(1)).sum())
        positions += len(tokens)
        below = theirs.max(1) - theirs[np.arange(len(tokens)), picked]  # [n]: 0 where the argmaxes agree
        assert below.max() <= NEAR_TIE, (ftype, tokenizer.decode(tokens), below.max())
        rel.extend(np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1))
    assert same >= TOP1_SHARE * positions, (ftype, same, positions)
    bound = MEDIAN_REL["float" if ftype in FLOAT_FILES else "quantised"]
    assert np.median(rel) <= bound, (ftype, np.median(rel))
