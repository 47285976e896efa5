"""GGUF files for the architecture tests (tests/native/test_gguf_arch.py), written here with the gguf package.

``edited_copy`` copies a file with some metadata keys set or dropped and some tensors added (a zoo file made into
one the gguf target must refuse, or Llama 3's rotary factors added to a llama file).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def edited_copy(source: str | Path, path: str | Path, keys: Mapping[str, Any] | None = None,
                drop: tuple[str, ...] = (), tensors: Mapping[str, np.ndarray] | None = None) -> str:
    """Write `source` to `path` with metadata `keys` set (a new key: a float is F32, an int UINT32, a str STRING,
    a bool BOOL; an existing key keeps its type), keys `drop` left out and F32 `tensors` added (in place of the
    source's of the same name); returns the path."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    keys = dict(keys or {})
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(path), arch)
    writer.kv_data[0].pop("general.architecture", None)  # written again below, in the source's order
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in drop:
            continue
        value = keys.pop(key, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub)
    for key, value in keys.items():
        kind = (GGUFValueType.BOOL if isinstance(value, bool) else GGUFValueType.UINT32 if isinstance(value, int)
                else GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.STRING)
        writer.add_key_value(key, value, kind)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name not in tensors:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, values in tensors.items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
