"""`specdec bench --concurrency 1,2,4,8`: throughput of the batched engine under N concurrent clients.

For each concurrency c, c client threads pull the same list of requests (the
prompt set, cycled to 2 × the largest c requests) through one engine with
batching enabled (``Engine.enable_batching``, specdec.runtime.batching), as a server's clients would: each
client sends its next request as soon as the previous one is answered
(closed loop).  Three ways of decoding run at every c, interleaved (their
order rotates between levels and repeats):

- ``plain``: batched plain decoding (nothing drafted);
- ``specdec-auto``: batched speculative decoding, each request's k chosen by the
  cost-model controller for the load of the whole batch (specdec.algorithm.control);
- ``specdec`` (``-g<γ>`` in a sweep): batched speculative decoding with a fixed γ.

Reported per method and c: total tokens/s (all new tokens ÷ wall time of the
level), mean latency per request, the mean k drafted per step, tokens per
packed forward, and whether every request's output equals its plain
single-client output (greedy).  The plot ``concurrency.png`` shows throughput
and mean k against c.
"""

from __future__ import annotations

import json
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.bench.plotting import MISSING, pyplot
from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.runtime.engine import Engine


@dataclass
class LevelResult:
    """One method at one concurrency (one repeat)."""

    method: str
    concurrency: int
    repeat: int
    requests: int
    new_tokens: int
    wall_s: float
    latencies_s: list[float]
    drafted: int
    steps: int  # decode steps after the prefills, over all requests
    forwards: int  # packed target forwards
    slots_served: int  # requests served by those forwards (sum of batch sizes)
    identical: int  # requests whose tokens equal their plain single-client output
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_k(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def mean_batch(self) -> float:
        return self.slots_served / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, mean_k=self.mean_k, mean_batch=self.mean_batch)
        return d


def parse_levels(text: str) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8]; a one-line SpecdecError for anything else."""
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SpecdecError(f"--concurrency takes a comma-separated list of client counts, got '{text}'") from None
    if not levels or levels[0] < 1:
        raise SpecdecError(f"--concurrency needs client counts >= 1, got '{text}'")
    if levels[-1] > 64:
        raise SpecdecError(f"--concurrency of {levels[-1]} clients is more than 64")
    return levels


def run_level(engine: Engine, requests: Sequence[list[int]], concurrency: int, max_new_tokens: int,
              k: int | str | None) -> tuple[float, list[Any]]:
    """Run `requests` (token ids) through `engine` (batching) with `concurrency` closed-loop clients; k None = plain.
    Returns (wall seconds, [(index, Result, latency s)])."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(requests)):
        todo.put(i)
    done: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            try:
                result = engine.generate(requests[i], max_new_tokens=max_new_tokens, use_draft=k is not None,
                                        num_speculative_tokens=k if k is not None else 1)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
                return
            with lock:
                done.append((i, result, time.perf_counter() - start))

    threads = [threading.Thread(target=client, name=f"bench-client-{c}") for c in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, sorted(done, key=lambda d: d[0])


def run_concurrency(
    engine: Engine,
    prompts: Sequence[list[int]],
    levels: Sequence[int],
    max_new_tokens: int,
    methods: Sequence[tuple[str, int | str | None]],
    repeats: int = 1,
    advance: Callable[[str], None] = lambda _: None,
    write: Callable[[LevelResult], None] = lambda _: None,
) -> list[LevelResult]:
    """Every method at every level (methods: (name, k), k None = plain) through `engine`, its batching
    enabled (specdec.runtime.batching.BatchPool); see the module doc."""
    from specdec.runtime.batching import BatchPool

    batch = engine.pool
    assert isinstance(batch, BatchPool), "run_concurrency needs the engine's batching enabled"
    if max(levels) > batch.max_batch:
        raise SpecdecError(f"a concurrency of {max(levels)} needs a batch of that many slots (have {batch.max_batch})")
    count = max(2 * max(levels), len(prompts))
    requests = [list(prompts[i % len(prompts)]) for i in range(count)]
    # the reference: plain decoding, one client; then a warm-up of each method (first calls allocate)
    _, plain = run_level(engine, requests, 1, max_new_tokens, None)
    reference = [r.token_ids for _, r, _ in plain]
    advance("reference")
    for _, k in methods:
        run_level(engine, requests[: min(2, len(requests))], min(2, max(levels)), max_new_tokens, k)
    advance("warm-up")
    results: list[LevelResult] = []
    turn = 0
    for level in levels:
        for rep in range(repeats):
            for name, k in [*methods[turn % len(methods):], *methods[: turn % len(methods)]]:
                target = batch.target
                forwards0, served0 = target.forwards, target.batched
                wall, done = run_level(engine, requests, level, max_new_tokens, k)
                stats = [r.stats for _, r, _ in done]
                row = LevelResult(
                    method=name, concurrency=level, repeat=rep, requests=len(done),
                    new_tokens=sum(s.new_tokens for s in stats), wall_s=wall,
                    latencies_s=[lat for _, _, lat in done],
                    drafted=sum(s.drafted for s in stats), steps=sum(s.draft_steps + s.plain_steps for s in stats),
                    forwards=target.forwards - forwards0, slots_served=target.batched - served0,
                    identical=sum(r.token_ids == reference[i] for i, r, _ in done),
                    outputs=[r.token_ids for _, r, _ in done],
                )
                results.append(row)
                write(row)
                advance(f"{name} × {level}")
            turn += 1
    return results


def summarize(results: Sequence[LevelResult]) -> list[dict[str, Any]]:
    """Per method and level: medians over repeats."""
    groups: dict[tuple[str, int], list[LevelResult]] = {}
    for r in results:
        groups.setdefault((r.method, r.concurrency), []).append(r)
    rows = []
    for (method, level), rs in groups.items():
        rows.append({
            "method": method, "concurrency": level,
            "tokens_per_s": statistics.median(r.tokens_per_s for r in rs),
            "mean_latency_s": statistics.median(statistics.mean(r.latencies_s) for r in rs),
            "mean_k": statistics.median(r.mean_k for r in rs),
            "mean_batch": statistics.median(r.mean_batch for r in rs),
            "tokens_per_forward": statistics.median(
                (r.new_tokens - r.requests) / max(r.forwards - r.requests, 1) for r in rs),
            "identical_rate": sum(r.identical for r in rs) / sum(r.requests for r in rs),
        })
    return rows


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    levels = sorted({r["concurrency"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    at = {(r["method"], r["concurrency"]): r for r in rows}
    base = {lvl: at.get(("plain", lvl), {}).get("tokens_per_s") for lvl in levels}
    one = {m: at.get((m, levels[0]), {}).get("tokens_per_s") for m in methods}
    lines = [
        "# specdec bench --concurrency", "",
        f"target {meta.get('target')} ({meta.get('dtype')}), drafter {meta.get('draft')}, "
        f"{meta.get('requests')} requests of at most {meta.get('max_new_tokens')} new tokens per level, "
        f"{meta.get('repeats')} repeat(s), CPU: {meta.get('cpu')}, torch threads {meta.get('torch_threads')}.", "",
        "| method | clients | tokens/s | × plain, same clients | × itself at " + str(levels[0]) +
        " client(s) | mean latency (s) | mean k | requests per forward | identical to plain |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        for lvl in levels:
            r = at.get((m, lvl))
            if r is None:
                continue
            vs_plain = r["tokens_per_s"] / base[lvl] if base.get(lvl) else None
            vs_one = r["tokens_per_s"] / one[m] if one.get(m) else None
            lines.append(
                f"| {m} | {lvl} | {r['tokens_per_s']:.2f} | {'–' if vs_plain is None else f'{vs_plain:.2f}×'} | "
                f"{'–' if vs_one is None else f'{vs_one:.2f}×'} | {r['mean_latency_s']:.2f} | {r['mean_k']:.2f} | "
                f"{r['mean_batch']:.2f} | {r['identical_rate']:.0%} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """concurrency.png: tokens/s and mean k against the number of clients, one line per method."""
    try:
        plt = pyplot()
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [r["tokens_per_s"] for r in mine], marker="o", label=method)
        right.plot(xs, [r["mean_k"] for r in mine], marker="o", label=method)
    for ax, label in ((left, "total tokens/s"), (right, "mean draft tokens per step (k)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    path = out / "concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: Sequence[LevelResult], meta: dict[str, Any], out: Path) -> dict[str, Any]:
    rows = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    data = {"levels": rows, "config": meta}
    (out / "summary.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
    (out / "summary.md").write_text(markdown(rows, meta))
    if plot(rows, out) is None:
        data["note"] = MISSING
    return data
