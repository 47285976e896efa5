"""The benchmark harness behind ``specdec bench``: every speedup side by side, with the peer.

One loaded :class:`~specdec.runtime.engine.Engine` (target + draft, one dtype) serves
every method: our loop plain and speculative, and transformers' own
``generate`` plain, assisted (the peer) and with prompt lookup.  Prompts come
from a Spec-Bench JSONL file or a plain text file (:mod:`.prompts`); methods
are strategy objects (:mod:`.methods`); the runner interleaves them prompt by
prompt after a warm-up (:mod:`.runner`), or, for a workload of sessions with
repeated text (:mod:`.workloads`: code edits, agent loops, templates), turn by
turn with every method on its own conversation (:mod:`.sessions`); the records
are aggregated into a summary (:mod:`.results`); the report writes markdown,
JSON and plots (:mod:`.report`).

    >>> from specdec.bench import BenchOptions, run_bench
    >>> from specdec.engine_config import EngineConfig
    >>> summary = run_bench(BenchOptions(EngineConfig("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")))
"""

from specdec.bench.methods import METHODS, Measurement, Method, build_methods
from specdec.bench.prompts import BUILTIN, load_prompts
from specdec.bench.results import Record, Summary, aggregate
from specdec.bench.runner import BenchOptions, run_bench, run_interleaved
from specdec.bench.sessions import run_sessions
from specdec.bench.workloads import WORKLOADS, Session, load_workloads
from specdec.prompt_files import Prompt

__all__ = [
    "BUILTIN", "METHODS", "WORKLOADS", "BenchOptions", "Measurement", "Method", "Prompt", "Record", "Session",
    "Summary", "aggregate", "build_methods", "load_prompts", "load_workloads", "run_bench", "run_interleaved",
    "run_sessions",
]
