"""The ctypes side of specdec's kernels matches their C header (specdec.native.kernels.bindings).

- Every function the header declares is in the signature table, with the same result type and the
  same argument types (a struct pointer as a pointer to its ctypes mirror), and nothing else is.
- Each struct's ctypes mirror has the C compiler's size, and each field its offset and kind of type.
- The header is part of what the library's cache key and version hash.
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest

from specdec.native.kernels import bindings, build

KINDS = {ctypes.c_int: "int", ctypes.c_int64: "int64", ctypes.c_float: "float", ctypes.c_void_p: "ptr"}


def prototypes() -> dict[str, tuple[str, list[str]]]:
    """The header's functions: name -> (result type, [parameter declarations])."""
    text = re.sub(r"/\*.*?\*/", "", build.HEADER.read_text(), flags=re.S)
    found = {}
    for result, name, params in re.findall(r"^(\w+)\s+(sd_\w+)\(([^)]*)\);", text, flags=re.M):
        declared = [" ".join(p.split()) for p in params.split(",")]
        found[name] = (result, [] if declared == ["void"] else declared)
    return found


def ctype_of(declaration: str) -> type:
    """The ctypes type a C parameter declaration is bound with."""
    if "*" in declaration:
        struct = next((bindings.STRUCTS[name] for name in bindings.STRUCTS if name in declaration.split()), None)
        return ctypes.c_void_p if struct is None else ctypes.POINTER(struct)
    return {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}[declaration.split()[0]]


def test_the_signature_table_is_the_header():
    declared = prototypes()
    assert declared and set(declared) == set(bindings.SIGNATURES)
    for name, (result, params) in declared.items():
        restype, argtypes = bindings.SIGNATURES[name]
        assert restype == {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "double": ctypes.c_double, "void": None}[result], name
        assert argtypes == [ctype_of(p) for p in params], name
    lib = bindings.library()
    assert lib.sd_layers.argtypes == bindings.SIGNATURES["sd_layers"][1]  # the table typed the library


def test_the_structs_have_the_compilers_layout(tmp_path):
    lines = []
    for cname, struct in bindings.STRUCTS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof({cname}));')
        for field, _ in struct._fields_:
            member = f"(({cname} *)0)->{field}"
            kind = f'_Generic({member}, int: "int", int64_t: "int64", float: "float", default: "ptr")'
            lines.append(f'printf("{cname}.{field} %zu %s\\n", offsetof({cname}, {field}), {kind});')
    program = tmp_path / "layout.c"
    program.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"specdec_kernels.h\"\n"
                       "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    binary = tmp_path / "layout"
    done = subprocess.run([build.compiler(), "-std=c11", f"-I{build.FOLDER}", str(program), "-o", str(binary)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
    expected = []
    for cname, struct in bindings.STRUCTS.items():
        expected.append(f"{cname} {ctypes.sizeof(struct)}")
        expected += [f"{cname}.{field} {getattr(struct, field).offset} {KINDS[ctype]}"
                     for field, ctype in struct._fields_]
    assert printed == expected


def test_the_header_is_hashed_with_the_sources(tmp_path, monkeypatch):
    before = build.version()
    header = tmp_path / build.HEADER.name
    header.write_bytes(build.HEADER.read_bytes() + b"/* changed */\n")
    monkeypatch.setattr(build, "HEADER", header)
    assert build.version() != before


@pytest.mark.parametrize("name", [path.name for path in build.SOURCES])
def test_every_source_includes_the_header_and_declares_no_export_itself(name):
    text = (build.FOLDER / name).read_text()
    assert '#include "specdec_kernels.h"' in text
    exported = re.findall(r"^(?:int|void)\s+(sd_\w+)\([^)]*\)\s*;", text, flags=re.M)  # a hand-copied prototype
    assert exported == [], exported
