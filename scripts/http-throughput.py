"""Throughput of a running OpenAI-compatible server (`specdec serve`, with or without --replicas):
CLIENTS clients send the builtin bench prompts, one request at a time each, and the total
completion tokens over the wall time is printed, with the replicas that answered.

    python scripts/http-throughput.py URL MODEL [CLIENTS] [REQUESTS] [MAX_TOKENS]

e.g. python scripts/http-throughput.py http://127.0.0.1:8000 coder 4 16 64   (greedy decoding)
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from specdec.bench.prompts import load_prompts


def main(url: str, model: str, clients: int = 4, requests: int = 16, max_tokens: int = 64) -> None:
    prompts = [p.text for p in load_prompts("short")]  # the set its recorded numbers were measured on
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=600)

    def one(i: int) -> tuple[int, str]:
        response = client.completions.with_raw_response.create(
            model=model, prompt=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0)
        return response.parse().usage.completion_tokens, response.headers.get("x-specdec-replica", "-")

    one(0)  # warm-up: the first request's one-off costs stay out of the measure
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(1, requests + 1)))
    wall = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    replicas = Counter(r for _, r in results)
    print(f"{requests} requests, {clients} clients, {tokens} tokens in {wall:.1f} s: {tokens / wall:.2f} tokens/s, "
          f"{requests / wall:.3f} requests/s; answered by {dict(replicas)}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    main(args[0], args[1], *(int(a) for a in args[2:]))
