"""Test configuration, and the real models shared by every test that needs one.

Tiny models run far faster on one thread (no thread hand-off per tiny matmul),
so the suite uses one; tests of real models raise it to two for their own
duration with :func:`real_model_threads`, unless the suite runs in parallel
(``pytest -n 2``, the README's command), where each worker keeps one core.

In a parallel run the real tests go to two fixed groups (a scheduler of ours,
see ``pytest_xdist_make_scheduler``), so that each real model is loaded by one
worker only: the fp32 target and what
compares with it (test_real.py, test_real_universal.py) in one, the int8 and
llama.cpp tests and the tokenizer/zoo tests in the other.  The tiny tests fill
in around them.

Real zoo models are loaded once per session, per backend and dtype, by the
``real_hf`` and ``real_lcpp`` fixtures, and handed to every test that asks:
loading the 1.5B target takes longer than most tests that use it.  They come
from the user's model cache ($SPECDEC_HOME, default ~/.cache/specdec), which
persists across runs, as it does for a user after the first run.

In CI (``CI`` set in the environment, as .ci/run does) the llama.cpp backend is
required: a missing llama-cpp-python, or a build that cannot verify a draft in
one batch exactly, fails the run instead of skipping tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import settings

from specdec import zoo

torch.set_num_threads(1)

# The user's model cache, read before any test points $SPECDEC_HOME elsewhere.
USER_HOME = zoo.home()


@contextmanager
def user_home() -> Iterator[None]:
    """$SPECDEC_HOME = the user's cache for a while (real models load from there, never a test's temporary home)."""
    before = os.environ.get(zoo.HOME_ENV)
    os.environ[zoo.HOME_ENV] = str(USER_HOME)
    try:
        yield
    finally:
        if before is None:
            del os.environ[zoo.HOME_ENV]
        else:
            os.environ[zoo.HOME_ENV] = before


@pytest.fixture(autouse=True, scope="session")
def isolated_home(tmp_path_factory) -> Iterator[None]:
    """$SPECDEC_HOME = a temporary folder for the whole session: tests write nothing into the
    user's cache (measured step costs, converted models, ...) unless they ask for it through
    user_home (as the real-model fixtures do)."""
    before = os.environ.get(zoo.HOME_ENV)
    os.environ[zoo.HOME_ENV] = str(tmp_path_factory.mktemp("specdec-home"))
    yield
    if before is None:
        del os.environ[zoo.HOME_ENV]
    else:
        os.environ[zoo.HOME_ENV] = before


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# CI replays the same hypothesis examples every run (a new edge case found there would block an
# unrelated change, and would be gone on the rerun); elsewhere every run explores new ones.
settings.register_profile("ci", derandomize=True)
if in_ci():
    settings.load_profile("ci")


def parallel_workers() -> int:
    """How many pytest-xdist workers share the machine (1 in a plain run)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


# In a parallel run, the modules that load real models run in two fixed groups, a group per worker:
# each real model is then loaded by one worker only (within the 24 GiB of a CI machine), and no
# two workers load the same one.  Every other test is a work unit of its own.
REAL_MODEL_GROUPS = {
    "tests/test_real.py": "fp32-target",  # the fp32 1.5B and 0.5B
    "tests/test_real_universal.py": "fp32-target",  # the fp32 1.5B, int8 drafts of other tokenizers
    "tests/test_real_int8.py": "int8-and-llama.cpp",  # the int8 zoo
    "tests/test_real_gguf.py": "fp32-target",  # the zoo on its own blocks, the int8 0.5B as an int4 draft
    "tests/native/test_gguf_arch_real.py": "int8-and-llama.cpp",  # smollm2 / gemma3 on their blocks and llama.cpp
    "tests/test_real_gguf_types.py": "fp32-target",  # smollm2-135m requantised to each type, its own file as draft
    "tests/backends/test_llamacpp.py": "int8-and-llama.cpp",  # the llama.cpp 1.5B / 0.5B, the int8 1.5B
    "tests/test_bridge.py": "int8-and-llama.cpp",  # the real tokenizers
    "tests/test_tokenizer.py": "int8-and-llama.cpp",  # the real tokenizers, lean and transformers'
    "tests/test_zoo.py": "int8-and-llama.cpp",
    "tests/runtime/test_loading.py": "int8-and-llama.cpp",
}
GROUP_ORDER = ["int8-and-llama.cpp", "fp32-target"]  # the longest first
# Modules whose tests share a costly module fixture run whole on one worker, each module a work unit:
# tests/serve/test_ray.py starts a local Ray cluster with two replicas (once, not once per worker).
ONE_WORKER_MODULES = {"tests/serve/test_ray.py"}


def module_of(nodeid: str) -> str:
    """tests/x.py::test_y[z] -> tests/x.py"""
    return nodeid.split("::", 1)[0]


def real_model_group(nodeid: str) -> str | None:
    return REAL_MODEL_GROUPS.get(module_of(nodeid))


def pytest_collection_modifyitems(config, items) -> None:
    """In a parallel run's workers: the real-model groups first, longest first (so that no worker
    starts one late and runs alone at the end); the order within a module is kept.  A real-model
    test in a module outside the groups is a usage error: it would load its models in every worker."""
    ungrouped = sorted({module_of(item.nodeid) for item in items
                        if item.get_closest_marker("real") is not None and real_model_group(item.nodeid) is None})
    if ungrouped:
        raise pytest.UsageError(f"tests marked `real` outside REAL_MODEL_GROUPS (tests/conftest.py): {ungrouped}")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {g: i for i, g in enumerate(GROUP_ORDER)}
        items.sort(key=lambda item: rank.get(real_model_group(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: the suite also runs without it
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N`: the load scheduler, with each real-model group (and each of ONE_WORKER_MODULES)
    as one work unit."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RealModelGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = module_of(nodeid)
            return real_model_group(nodeid) or (module if module in ONE_WORKER_MODULES else nodeid)

    return RealModelGroups(config, log)


@contextmanager
def real_model_threads() -> Iterator[None]:
    """Both cores while real models run (one per worker in a parallel run), then back to what it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if parallel_workers() > 1 else 2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def require_llama_cpp():
    """llama_cpp, or a skip where it is not installed -- except in CI, where it must be."""
    if in_ci():
        import llama_cpp

        return llama_cpp
    return pytest.importorskip("llama_cpp")


def require_ray():
    """ray (with Ray Serve), or a skip where the ray extra is not installed -- except in CI, where
    it must be (.ci/run installs it)."""
    if in_ci():
        import ray
        import ray.serve  # noqa: F401

        return ray
    pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install -e '.[ray]'")
    import ray

    return ray


# Real transformers models kept at once, in bytes of weights: an fp32 1.5B model and the int8 one
# fit; beyond that the least recently used is dropped (tests still holding it keep it alive).
REAL_HF_BUDGET = 10 * 2**30


def model_bytes(model) -> int:
    """Weights held by a transformers model (fp32/bf16 parameters, int8 linears at a byte a weight)."""
    from specdec.native.quant import Int8Linear

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8Linear))


@pytest.fixture(scope="session")
def real_hf() -> Callable:
    """get(name, dtype="fp32") -> (model, tokenizer) of a real zoo model, loaded once per session
    (within REAL_HF_BUDGET: the least recently used model is reloaded if it was dropped)."""
    from specdec.runtime.loading import load_hf

    loaded: dict = {}  # (name, dtype) -> (model, tokenizer), least recently used first

    def get(name: str, dtype: str = "fp32"):
        key = (name, dtype)
        if key in loaded:
            loaded[key] = loaded.pop(key)  # now the most recently used
            return loaded[key]
        with real_model_threads(), user_home():
            loaded[key] = load_hf(name, dtype=dtype)
        while len(loaded) > 1 and sum(model_bytes(m) for m, _ in loaded.values()) > REAL_HF_BUDGET:
            del loaded[next(iter(loaded))]
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def real_gguf() -> Callable:
    """get(name, requantize=None) -> (GGUFRunner, tokenizer) of a real zoo model on its own blocks
    (specdec.native.gguf; requantize=Q4_1: a draft's weights in 4 bits), loaded once per session; each call
    hands out a runner of its own over the one loaded model (GGUFRunner.clone)."""
    from specdec.runtime.loading import load_gguf

    loaded: dict = {}

    def get(name: str, requantize: int | None = None):
        key = (name, requantize)
        if key not in loaded:
            with real_model_threads(), user_home():
                loaded[key] = load_gguf(name, requantize=requantize)
        runner, tokenizer = loaded[key]
        return runner.clone(), tokenizer

    return get


@pytest.fixture(scope="session")
def real_lcpp() -> Iterator[Callable]:
    """get(name, exact=True) -> (LlamaCppRunner, tokenizer), loaded once per session.

    One thread, a 1024-token context: on a shared 2-core machine a second
    llama.cpp thread mostly waits.  Callers must leave the runner reusable
    (any cache state is fine: the decode loop resets the target).
    """
    require_llama_cpp()
    from specdec.runtime.loading import load_llamacpp

    loaded: dict = {}

    def get(name: str, exact: bool = True):
        if (name, exact) not in loaded:
            with user_home():
                loaded[(name, exact)] = load_llamacpp(name, exact=exact, n_ctx=1024, n_threads=1)
        return loaded[(name, exact)]

    yield get
    for runner, _ in loaded.values():
        runner.close()


@pytest.fixture
def cached_loaders(monkeypatch, real_hf, real_gguf, real_lcpp_optional) -> None:
    """Make Engine.load (and so the CLI, in-process) take the session's loaded models.

    Everything but reading weights from disk runs as for a user: name checks,
    backend choice, engine construction, generation and output.
    """
    import specdec.runtime.loading

    monkeypatch.setattr(specdec.runtime.loading, "load_hf",
                        lambda spec, dtype="fp32", progress=None, device="cpu": real_hf(spec, dtype))
    monkeypatch.setattr(specdec.runtime.loading, "load_gguf",
                        lambda spec, progress=None, max_context=None, requantize=None: real_gguf(spec, requantize))
    if real_lcpp_optional is not None:
        monkeypatch.setattr(
            specdec.runtime.loading, "load_llamacpp",
            lambda spec, n_ctx=None, exact=True, progress=None, n_threads=None: real_lcpp_optional(spec, exact),
        )


@pytest.fixture
def real_lcpp_optional(request) -> Callable | None:
    """real_lcpp where llama-cpp-python is installed (always in CI), else None."""
    try:
        if not in_ci():
            import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return request.getfixturevalue("real_lcpp")
