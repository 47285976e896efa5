"""A stand-in for llama.cpp's llama-bench in the bench's tests: its command line (-m, -t, -p, -n, -d, -r, -o json)
and its JSON rows, with made-up times that follow from the test (no model, nothing timed):

- pp<k>: (10 + 2k) ms a repetition (one forward of k tokens); tg<n>: 12 ms a token;
- FAKE_LLAMA_BENCH_MODE=fail: an error line on stderr and exit 1, as a llama-bench that cannot load its model;
- each run is appended to $FAKE_LLAMA_BENCH_LOG (one JSON line: its arguments, and the pids written into
  $FAKE_LLAMA_SERVER_PIDS by tests/bench/fake_llama_server.py whose processes still run)."""

import json
import os
import sys
from pathlib import Path


def option(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def alive_servers() -> list[int]:
    folder = os.environ.get("FAKE_LLAMA_SERVER_PIDS")
    pids = [int(p.name) for p in Path(folder).iterdir()] if folder and Path(folder).is_dir() else []
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def main() -> None:
    args = sys.argv[1:]
    log = os.environ.get("FAKE_LLAMA_BENCH_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"args": args, "alive_servers": alive_servers()}) + "\n")
    if os.environ.get("FAKE_LLAMA_BENCH_MODE") == "fail":
        print("main: error: failed to load model 'x.gguf'", file=sys.stderr)
        sys.exit(1)
    threads, depth, reps = int(option(args, "-t", "2")), int(option(args, "-d", "0")), int(option(args, "-r", "5"))
    tests = [(int(p), 0) for p in option(args, "-p", "512").split(",") if int(p)]
    tests += [(0, int(n)) for n in option(args, "-n", "128").split(",") if int(n)]
    rows = []
    for n_prompt, n_gen in tests:
        ns = (10 + 2 * n_prompt) * 1_000_000 if n_prompt else 12_000_000 * n_gen
        tokens = n_prompt or n_gen
        rows.append({"build_commit": "fake123", "cpu_info": "Fake CPU", "model_filename": option(args, "-m", ""),
                     "model_type": "qwen2 1.5B Q4_K - Medium", "n_threads": threads, "n_prompt": n_prompt,
                     "n_gen": n_gen, "n_depth": depth, "avg_ns": ns, "stddev_ns": 0, "avg_ts": tokens / (ns / 1e9),
                     "stddev_ts": 0.0, "samples_ns": [ns] * reps, "samples_ts": [tokens / (ns / 1e9)] * reps})
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
