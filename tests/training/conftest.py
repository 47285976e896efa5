"""tests/training/ trains on tests/head/'s tiny target and its own text (session fixtures, the same here)."""

from tests.head.conftest import target, text

__all__ = ["target", "text"]  # pytest's fixtures, found here by name
