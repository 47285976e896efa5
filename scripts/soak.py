"""A server soak: `specdec serve --memory-budget` under mixed traffic; its answers stay right and its memory bounded.

Starts `specdec serve` as a user runs it (a subprocess, with --memory-budget, --max-batch and suffix drafts) and
for --duration seconds sends, from --clients threads, a mix drawn from seeds: short completions, chats, long
prompts (--long-words words, a few thousand tokens), streamed completions, streams the client leaves after two
chunks (a disconnect mid-stream), and seeded sampled requests.  Requests repeat (--distinct prompts per kind), so
prefix reuse and the suffix drafts' store are exercised too.  Every --every seconds it prints the requests done,
the server's RSS and what /metrics says is reserved of the budget; a thread samples the RSS every 0.2 s.

At the end it re-sends every distinct greedy request once, one at a time, and checks that every greedy answer
of the soak equals that sequential answer; it counts 5xx answers (must be 0), 413s and other errors, reports the
peak RSS against the RSS once the models were loaded plus the budget, and checks the server is still alive.
Exit status 1 when a check fails.

    python scripts/soak.py [--duration 600] [--clients 4] [--memory-budget 1GiB] [--max-batch 2]
                           [--target SPEC] [--dtype DTYPE] [--long-words 2000] [--max-tokens 64]

Without --target it serves a tiny random model saved to a temporary directory (tests.tiny: no download; run
from the repository root), so requests take milliseconds and the numbers are the server's, not a model's.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<bos>assistant:{% endif %}")
WORDS = ("def return value list index parse request token model draft server memory store answer tool call "
         "json file edit line change update function class import print error result query table select "
         "where order limit agent observation step plan write read test pass fail").split()
KINDS = ("short", "chat", "long", "stream", "cancel", "sampled")
GREEDY = ("short", "chat", "long", "stream")


def start_server(args: argparse.Namespace, target: str, log: Path) -> tuple[str, subprocess.Popen]:
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", target, "--draft", "suffix", "-k", "auto",
               "--host", "127.0.0.1", "--port", "0", "--served-model-name", "soak", "--max-queue", "64",
               "--max-batch", str(args.max_batch), "--memory-budget", args.memory_budget,
               "--max-tokens-limit", str(max(args.max_tokens, 16))]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.dtype:
        command += ["--dtype", args.dtype]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=os.environ.copy())
    deadline = time.monotonic() + 900
    while True:
        text = log.read_text()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", text)
        if match and "models loaded" in text:
            url = match.group(1)
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"specdec serve did not start:\n{text[-3000:]}")
        time.sleep(0.2)
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.05)
    return url, process


def body(kind: str, key: int, args: argparse.Namespace) -> tuple[str, dict]:
    """(endpoint, JSON body) of request `key` of `kind` (drawn from its seed: the same key, the same request)."""
    rng = random.Random(f"{kind}-{key}")
    words = args.long_words if kind == "long" else rng.randint(4, 40)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words)) + f" #{kind}{key}"
    out: dict = {"model": "soak", "max_tokens": rng.randint(8, args.max_tokens), "temperature": 0}
    if kind == "chat":
        return "/v1/chat/completions", {**out, "messages": [{"role": "user", "content": prompt}]}
    if kind == "sampled":
        out.update(temperature=0.8, seed=key)
    if kind in ("stream", "cancel"):
        out["stream"] = True
    return "/v1/completions", {**out, "prompt": prompt}


def streamed(response: httpx.Response, leave_after: int | None = None) -> str | None:
    """The text of a completion stream; None when the client left after `leave_after` chunks."""
    import json

    text, chunks = [], 0
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"error event: {event['error']}")
        text += [c.get("text") or "" for c in event["choices"]]
        chunks += 1
        if leave_after is not None and chunks >= leave_after:
            return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def send(http: httpx.Client, url: str, kind: str, key: int, args: argparse.Namespace) -> tuple[int, str | None]:
    """(HTTP status, the answer's text; None for a stream the client left or an error)."""
    endpoint, data = body(kind, key, args)
    if data.get("stream"):
        with http.stream("POST", url + endpoint, json=data) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, None
            return 200, streamed(response, 2 if kind == "cancel" else None)
    response = http.post(url + endpoint, json=data)
    if response.status_code != 200:
        return response.status_code, None
    choice = response.json()["choices"][0]
    return 200, choice["message"]["content"] if kind == "chat" else choice["text"]


def reserved(url: str) -> float:
    match = re.search(r"^specdec:memory_reserved_bytes (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(match.group(1)) if match else -1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--memory-budget", default="1GiB")
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--target", default=None, help="a model spec (default: a tiny random model)")
    parser.add_argument("--dtype", default=None, help="the target's --dtype (default: the server's)")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads")
    parser.add_argument("--long-words", type=int, default=2000, help="words in a long prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--distinct", type=int, default=40, help="distinct requests of each kind")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between progress lines")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as scratch:
        target = args.target
        if target is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from transformers import AutoTokenizer

            from tests.tiny import save_tiny

            target = save_tiny(Path(scratch) / "tiny", "llama", seed=0, positions=32768)
            tokenizer = AutoTokenizer.from_pretrained(target)
            tokenizer.chat_template = CHAT_TEMPLATE  # for /v1/chat/completions
            tokenizer.save_pretrained(target)
        log = Path(scratch) / "serve.log"
        url, process = start_server(args, target, log)
        memory = psutil.Process(process.pid)
        loaded = memory.memory_info().rss  # the models and the server, before any request
        peak, sampling = [loaded], threading.Event()

        def sample() -> None:
            while not sampling.wait(0.2):
                try:
                    peak[0] = max(peak[0], memory.memory_info().rss)
                except psutil.Error:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        statuses: Counter[int] = Counter()
        answers: dict[tuple[str, int], set[str]] = {}
        errors: list[str] = []
        lock = threading.Lock()
        began = time.monotonic()
        print(f"serving at {url}; RSS once loaded {loaded / 2**20:.0f} MiB; budget {args.memory_budget}", flush=True)
        print(f"{'s':>6} {'requests':>8} {'RSS MiB':>8} {'peak MiB':>8} {'reserved MiB':>12}", flush=True)

        def client(c: int) -> None:
            rng = random.Random(c)
            with httpx.Client(timeout=900) as http:
                while time.monotonic() - began < args.duration:
                    kind, key = rng.choice(KINDS), rng.randrange(args.distinct)
                    try:
                        status, text = send(http, url, kind, key, args)
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        with lock:
                            errors.append(f"{kind} {key}: {type(e).__name__}: {e}")
                        continue
                    with lock:
                        statuses[status] += 1
                        if status == 200 and kind in GREEDY and text is not None:
                            answers.setdefault((kind, key), set()).add(text)

        try:
            with ThreadPoolExecutor(args.clients) as pool:
                futures = [pool.submit(client, c) for c in range(args.clients)]
                due = began + args.every
                while not all(f.done() for f in futures):
                    time.sleep(0.2)
                    if time.monotonic() >= due:
                        due += args.every
                        print(f"{time.monotonic() - began:6.0f} {sum(statuses.values()):8d} "
                              f"{memory.memory_info().rss / 2**20:8.0f} {peak[0] / 2**20:8.0f} "
                              f"{reserved(url) / 2**20:12.1f}", flush=True)
                for f in futures:
                    f.result()
            # the reference: each distinct greedy request once, alone
            mismatches = []
            with httpx.Client(timeout=900) as http:
                for (kind, key), got in sorted(answers.items()):
                    status, alone = send(http, url, kind, key, args)
                    if status != 200 or got != {alone}:
                        mismatches.append(f"{kind} {key}: {len(got)} answers, alone ({status}) {alone!r:.60}")
            alive = process.poll() is None and httpx.get(url + "/health").status_code == 200
        finally:
            sampling.set()
            process.terminate()
            process.wait(60)
        budget_line = re.search(r"memory budget ([^\n]*)", log.read_text())
        server_errors = sum(n for s, n in statuses.items() if s >= 500)
        print(f"requests: {sum(statuses.values())} by status {dict(sorted(statuses.items()))}; client errors: "
              f"{len(errors)}")
        print(f"greedy requests checked against a sequential run: {len(answers)} distinct, "
              f"{len(mismatches)} differ")
        print(f"peak RSS {peak[0] / 2**20:.0f} MiB = {loaded / 2**20:.0f} MiB once loaded + "
              f"{(peak[0] - loaded) / 2**20:.0f} MiB; memory budget {budget_line.group(1) if budget_line else '?'}")
        print(f"server alive at the end: {alive}")
        for line in (errors + mismatches)[:10]:
            print("  " + line)
        failed = server_errors or errors or mismatches or not alive
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
