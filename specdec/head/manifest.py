"""A draft head's manifest (specdec.head.store writes it beside the weights): where a target's head is kept,
reading and checking a manifest, the table of the heads saved here; all without torch (`specdec models` lists
the heads, and the command line checks a spec, before anything loads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError
from specdec.zoo import home

MANIFEST = "manifest.json"
FORMAT = 1
OLD_WINDOW = None  # the attention window of a head saved before manifests recorded one: all positions


def default_directory(target_name: str) -> Path:
    """$SPECDEC_HOME/drafters/<target>-head/ (a path-like name flattened to one directory name)."""
    flat = target_name.strip("/").replace("/", "--") or "target"
    return home() / "drafters" / f"{flat}-head"


def has_head(target_name: object) -> bool:
    """Whether a head is saved for the target named `target_name` in its default directory."""
    return isinstance(target_name, str) and (default_directory(target_name) / MANIFEST).is_file()


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of the head in `directory`, or a one-line SpecdecError."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise SpecdecError(f"no draft head in {directory}: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest["format"] != FORMAT or not isinstance(manifest["target"], dict):
            raise ValueError(f"format {manifest['format']}")
        missing = [key for key in ("weights", "weights_sha256", "draft_vocab") if key not in manifest]
        if missing:
            raise KeyError(missing[0])
        window = manifest.get("attention_window", OLD_WINDOW)  # a positive int, or None: all positions
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"attention_window {window!r} is not a positive whole number")
        for key, what in (("tapped_layers", "layer indices"), ("cursor", "counts")):
            values = manifest.get(key, [])
            if not isinstance(values, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in values):
                raise ValueError(f"{key} {values!r} is not a list of {what}")
        for key in ("tokens_seen", "steps", "runs", "training_seconds"):  # what a resumed run adds to
            value = manifest.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                    (key != "training_seconds" and not isinstance(value, int)):
                raise ValueError(f"{key} {value!r} is not a count")
        if not isinstance(manifest.get("data", []), list):
            raise ValueError(f"data {manifest['data']!r} is not a list")
    except (ValueError, KeyError, TypeError) as e:
        raise SpecdecError(f"broken draft-head manifest {path}: {e}") from None
    return manifest



def heads_table() -> list[dict[str, Any]]:
    """One row per head saved in $SPECDEC_HOME/drafters/ (a manifest that cannot be read says so)."""
    rows = []
    for manifest in sorted((home() / "drafters").glob("*/manifest.json")):
        directory = manifest.parent
        try:
            m = read_manifest(directory)
            rows.append({
                "directory": str(directory),
                "target": m["target"].get("name") or "?",
                "draft_vocab": len(m["draft_vocab"]),
                "tokens_seen": int(m.get("tokens_seen", 0)),
                # None: a position not measured yet (a checkpoint before the first evaluation)
                "agreement_by_position": [None if a is None else round(float(a), 3)
                                          for a in m.get("agreement_by_position", [])],
                "training_minutes": round(float(m.get("training_seconds", 0.0)) / 60, 1),
            })
        except SpecdecError as e:
            rows.append({"directory": str(directory), "target": "?", "error": str(e)})
        except (TypeError, ValueError, AttributeError) as e:
            rows.append({"directory": str(directory), "target": "?", "error": f"broken manifest {manifest}: {e}"})
    return rows
