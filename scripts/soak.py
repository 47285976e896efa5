"""A server soak: `specdec serve` with suffix drafts answers many requests; its memory must stay bounded.

The suffix drafts' store keeps recent answers up to --suffix-memory tokens (specdec.drafters.suffix),
so once it is full a server's resident memory should stop growing.  This starts `specdec serve` as a
user runs it (a subprocess), sends REQUESTS requests from CLIENTS threads (completions and chat, greedy,
prompts and lengths drawn from a seed, every one distinct), and every EVERY requests prints the
server's RSS and what the store holds (/metrics `specdec:suffix_store_tokens`); at the end, the largest
deviation of the RSS after WARMUP requests from its value then.

    python scripts/soak.py [--requests 10000] [--clients 4] [--warmup 1000] [--every 500]
                           [--suffix-memory N] [--target DIR] [--max-tokens 64]

Without --target it serves a tiny random model saved to a temporary directory (tests.tiny: no
download; run from the repository root), so requests take milliseconds and the numbers are the
server's and the store's, not a model's.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from openai import OpenAI

CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<bos>assistant:{% endif %}")
WORDS = ("def return value list index parse request token model draft server memory store answer tool call "
         "json file edit line change update function class import print error result query table select "
         "where order limit agent observation step plan write read test pass fail").split()


def start_server(target: str, suffix_memory: int | None, log: Path) -> tuple[str, subprocess.Popen]:
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", target, "--draft", "suffix", "-k", "auto",
               "--host", "127.0.0.1", "--port", "0", "--served-model-name", "soak", "--max-queue", "64",
               "--threads", "1"]
    if suffix_memory is not None:
        command += ["--suffix-memory", str(suffix_memory)]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=os.environ.copy())
    deadline = time.monotonic() + 300
    while True:
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if match:
            url = match.group(1)
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"specdec serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.05)
    return url, process


def request(client: OpenAI, n: int, max_tokens: int) -> int:
    """The n-th request (drawn from seed n): its completion tokens."""
    rng = random.Random(n)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) + f" #{n}"
    tokens = rng.randint(8, max_tokens)
    if n % 3 == 2:
        response = client.chat.completions.create(model="soak", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=tokens, temperature=0)
    else:
        response = client.completions.create(model="soak", prompt=prompt, max_tokens=tokens, temperature=0)
    return response.usage.completion_tokens


def store_tokens(url: str) -> int:
    match = re.search(r"^specdec:suffix_store_tokens (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return int(float(match.group(1))) if match else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--suffix-memory", type=int, default=None, help="default: the server's default")
    parser.add_argument("--target", default=None, help="a model spec (default: a tiny random model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as scratch:
        target = args.target
        if target is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from transformers import AutoTokenizer

            from tests.tiny import save_tiny

            target = save_tiny(Path(scratch) / "tiny", "llama", seed=0, positions=1024)
            tokenizer = AutoTokenizer.from_pretrained(target)
            tokenizer.chat_template = CHAT_TEMPLATE  # for /v1/chat/completions
            tokenizer.save_pretrained(target)
        url, process = start_server(target, args.suffix_memory, Path(scratch) / "serve.log")
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        memory = psutil.Process(process.pid)
        began, done, tokens, at_warmup, deviation = time.monotonic(), 0, 0, None, 0.0
        print(f"{'requests':>8} {'tokens':>9} {'store tokens':>12} {'RSS MiB':>8} {'vs warm-up':>10} {'s':>6}")
        try:
            with ThreadPoolExecutor(args.clients) as pool:
                while done < args.requests:
                    batch = range(done, min(done + args.every, args.requests))
                    tokens += sum(pool.map(lambda n: request(client, n, args.max_tokens), batch))
                    done = batch[-1] + 1
                    rss = memory.memory_info().rss
                    if at_warmup is None and done >= args.warmup:
                        at_warmup = rss
                    change = (rss / at_warmup - 1) if at_warmup and done > args.warmup else 0.0
                    deviation = max(deviation, abs(change))
                    print(f"{done:8d} {tokens:9d} {store_tokens(url):12d} {rss / 2**20:8.1f} "
                          f"{change:+10.1%} {time.monotonic() - began:6.0f}", flush=True)
        finally:
            process.terminate()
            process.wait(30)
        print(f"largest RSS deviation after {args.warmup} warm-up requests: {deviation:.1%}")


if __name__ == "__main__":
    main()
