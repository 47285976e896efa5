"""The benchmark's plots need matplotlib, the optional `bench` extra: imported here, only when a plot is drawn."""

from __future__ import annotations

from typing import Any

MISSING = "plots skipped: matplotlib is not installed (pip install 'specdec[bench]')"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display); an ImportError saying MISSING without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
