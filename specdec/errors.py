"""User-facing errors.

A :class:`SpecdecError` is a mistake the user can fix (a bad option, an unknown
model, a prompt that does not fit).  The CLI prints its message as one line and
exits with status 2; it never shows a traceback for these.  Anything else that
escapes is a bug in specdec and is allowed to show its traceback.
"""


class SpecdecError(Exception):
    """A user error with a one-line, actionable message."""


class IncompatibleDraftError(SpecdecError):
    """The draft model cannot draft for the target (e.g. another vocabulary)."""
