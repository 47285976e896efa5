"""tests/training/ trains on tests/head/'s tiny target and its own text, and checks its trained head (session
fixtures, the same here)."""

from tests.head.conftest import target, text, trained

__all__ = ["target", "text", "trained"]  # pytest's fixtures, found here by name
