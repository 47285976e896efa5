"""A JSON schema as a request gives it, checked for its shape before any library compiles it: shared by
specdec.constrain.spec (a Constraint, checked when made) and specdec.constrain.grammar (a Grammar, compiled from a
schema or its text).  Torch- and llguidance-free."""

from __future__ import annotations

import json
from typing import Any

from specdec.errors import SpecdecError


def parse_schema(schema: Any) -> dict[str, Any]:
    """A JSON schema given as its JSON text or as an object -> the object; a one-line SpecdecError for text that is
    not JSON or a schema that is not an object (what a schema is beyond that is the library's to check)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise SpecdecError(f"invalid JSON schema: an object is needed, not {type(schema).__name__}")
    return schema
