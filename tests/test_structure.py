"""The package's shape: no import cycle among specdec's modules, and no import running back up the house
(FLOORS: each module imports only from its own floor and the floors below it); at most MAX_TOP_MODULES
modules at the top of specdec/; no block of lines written twice, no function over MAX_FUNCTION_LINES lines
without a comment saying why it reads better whole.

Both read the sources with ``ast`` (no module of the package is run) in well under a second.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).resolve().parent  # specdec/
MIN_BLOCK = 6  # lines in a row that may not stand twice
BRACKETS = set("()[]{}'\",;:")  # a line of only these says nothing on its own
MAX_FUNCTION_LINES = 80  # a longer function needs a comment line right above it (or its decorators) with "whole" in it
LONG_EXEMPT: set[str] = set()  # "file.py:function" allowed over the limit without a comment: none
MAX_TOP_MODULES = 14  # .py files directly in specdec/, __init__.py counted; the rest live in its packages (README)
# The house, bottom floor first (docs/extending.md, "The layout"): a module may import from its own floor and the
# floors below, never from one above.  A package stands for all its modules; a top-level module is named on its own
# ("specdec" is the package's __init__, the public API, alone).  Every module has a floor.
FLOORS: list[tuple[str, ...]] = [
    # the ground: what every floor reads (errors, the defaults, the model files, the CPU, tokenizers, prompt files,
    # a request's text: the prompt's check, chat templating, the output as it streams; the grammars that constrain it)
    ("specdec.errors", "specdec.defaults", "specdec.zoo", "specdec.machine", "specdec.vocab", "specdec.tokenizer",
     "specdec.bridge", "specdec.prompt_files", "specdec.text", "specdec.chat", "specdec.constrain"),
    ("specdec.backends", "specdec.native"),  # the runners: transformers' and llama.cpp's adapters, the native engine
    ("specdec.algorithm",),  # the math and the decode loop, on the ModelRunner protocol and the draft types
    ("specdec.request",),  # one request's options: the algorithm's parts (controller, tree shape, sampling) parsed
    ("specdec.drafters", "specdec.head"),  # the drafters, a trained head's among them
    ("specdec.engine_config",),  # the models to load: drafter specs, backends, dtypes
    ("specdec.runtime",),  # loading, the engine, batching, measured costs
    ("specdec.bench", "specdec.serve", "specdec.training"),  # what runs the engine, or a target, for a purpose
    ("specdec.cli", "specdec"),  # the command line and the public API
]


def module_name(path: Path) -> str:
    """specdec/bench/runner.py -> "specdec.bench.runner"; specdec/bench/__init__.py -> "specdec.bench"."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    """Every module of the package: {dotted name: path}."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that the module `name` imports anywhere in `tree` (top level, in functions,
    under TYPE_CHECKING): ``import a.b`` names a.b; ``from a import b`` names a, and a.b when b is a
    module; relative imports are resolved against `name`."""
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, a module's imports of its own ancestors left out
    (a package's __init__ runs before its modules anyway)."""
    files = sources()
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets = imported(tree, name, path.name == "__init__.py", modules)
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (a depth-first search, in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imported_resolves_every_form() -> None:
    modules = {"specdec", "specdec.a", "specdec.b", "specdec.b.c", "specdec.b.d"}
    tree = ast.parse(
        "import specdec.a\n"
        "def f():\n    from specdec.b import c, name\n"
        "if TYPE_CHECKING:\n    from . import d\n"
    )
    assert imported(tree, "specdec.b.x", False, modules) == {"specdec.a", "specdec.b", "specdec.b.c", "specdec.b.d"}


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "specdec.algorithm.loop" in graph and "specdec.bench.report" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def floor_of(name: str, floors: list[tuple[str, ...]]) -> int | None:
    """The index in `floors` of the floor whose entry is `name`, or the package `name` is in (the longest such
    entry; a dotless entry, the root package, names its __init__ alone); None when no floor holds it."""
    found = [(len(entry), i) for i, floor in enumerate(floors) for entry in floor
             if name == entry or ("." in entry and name.startswith(entry + "."))]
    return max(found)[1] if found else None


def upward_imports(graph: dict[str, set[str]], floors: list[tuple[str, ...]]) -> list[str]:
    """"a -> b" for each import in `graph` of a module on a floor above a's, and "a: no floor" for each module
    that `floors` does not place."""
    level = {name: floor_of(name, floors) for name in graph}
    unplaced = [f"{name}: no floor" for name, at in sorted(level.items()) if at is None]
    upward = [f"{name} -> {target}" for name, targets in sorted(graph.items()) for target in sorted(targets)
              if (at := level[name]) is not None and (to := floor_of(target, floors)) is not None and to > at]
    return unplaced + upward


def test_upward_imports_found() -> None:
    graph = {"p.low.a": {"p.low.b", "p.high.c", "p.mid"}, "p.low.b": {"p.low.a"}, "p.high.c": {"p.low.a", "p.top"},
             "p.mid": {"p.low.b"}, "p.top": {"p.high.c"}, "p": {"p.top", "p.high.c"}, "p.stray": set()}
    floors = [("p.low", "p.mid"), ("p.high",), ("p.top", "p")]
    # both ways within a floor is allowed; "p" names the root's __init__, not everything in it
    assert floor_of("p.high.c", floors) == 1 and floor_of("p", floors) == 2 and floor_of("p.stray", floors) is None
    assert upward_imports(graph, floors) == ["p.stray: no floor", "p.high.c -> p.top", "p.low.a -> p.high.c"]


def test_no_import_runs_back_up_the_house() -> None:
    upward = upward_imports(import_graph(), FLOORS)
    assert not upward, "imports from a floor above, or modules on none (tests/test_structure.py's FLOORS):\n" + \
        "\n".join(upward)


def test_the_top_level_holds_few_modules() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, (f"{len(top)} modules at the top of specdec/ (at most {MAX_TOP_MODULES}): "
                                         f"{', '.join(top)}; put the new one in the package it belongs to")


def code_lines(path: Path) -> list[tuple[str, int]]:
    """(stripped text, line number) of each line of `path` that counts towards a repeated block: not
    blank, not only brackets or quotes, not part of an import statement or a docstring, its comment cut
    off (two blocks that differ only in a docstring's or a comment's words are the same code)."""
    text = path.read_text(encoding="utf-8")
    skip: set[int] = set()
    for node in ast.walk(ast.parse(text, str(path))):
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or docstring:
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    cut = {start[0]: start[1] for kind, _, start, _, _ in tokenize.generate_tokens(io.StringIO(text).readline)
           if kind == tokenize.COMMENT}  # line -> the column its comment starts at
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line[: cut.get(number, len(line))].strip()
        if stripped and number not in skip and not set(stripped) <= BRACKETS:
            out.append((stripped, number))
    return out


def repeated_blocks(files: list[Path], root: Path, size: int = MIN_BLOCK) -> list[tuple[str, str]]:
    """Pairs of places ("file:line", the file relative to `root`) where the same `size` counted lines
    stand in a row, one pair per repeated run (a longer run is reported once, at its start)."""
    seen: dict[tuple[str, ...], list[tuple[Path, int, int]]] = defaultdict(list)  # block -> (file, index, line)
    lines = {path: code_lines(path) for path in files}
    for path, counted in lines.items():
        texts = [t for t, _ in counted]
        for i in range(len(texts) - size + 1):
            seen[tuple(texts[i: i + size])].append((path, i, counted[i][1]))
    pairs: list[tuple[str, str]] = []
    for places in seen.values():
        for a, (path_a, i_a, line_a) in enumerate(places):
            for path_b, i_b, line_b in places[a + 1:]:
                if path_a == path_b and i_b - i_a < size:
                    continue  # a run of one repeated line overlapping itself
                texts_a, texts_b = lines[path_a], lines[path_b]
                if i_a > 0 and i_b > 0 and texts_a[i_a - 1][0] == texts_b[i_b - 1][0]:
                    continue  # inside a longer run, reported at its start
                pairs.append((f"{path_a.relative_to(root)}:{line_a}", f"{path_b.relative_to(root)}:{line_b}"))
    return pairs


def test_repeated_blocks_found(tmp_path: Path) -> None:
    lines = [f"x{i} = f({i})\n" for i in range(7)]
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("import os\n" + "".join(lines))
    second.write_text("y = g(\n    1,\n)\n\n" + "".join(lines[:3]) + "\nimport sys\n" + "".join(lines[3:]))
    assert [n for _, n in code_lines(second)] == [1, 2, 5, 6, 7, 10, 11, 12, 13]  # no ")", blank or import
    assert repeated_blocks([first, second], tmp_path) == [("a.py:2", "b.py:5")]
    assert repeated_blocks([first, second], tmp_path, size=8) == []
    # the same code under other docstrings and comments (HFRunner's and LeanRunner's hidden() once said "[n, H]"
    # and "[n, hidden]", and so stood twice unseen)
    body = [f"    y{i} = g({i})\n" for i in range(6)]
    third, fourth = tmp_path / "c.py", tmp_path / "d.py"
    third.write_text('def f():\n    """The rows [n, H]:\n    kept."""\n' + body[0].replace("\n", "  # one\n") + "".join(body[1:]))
    fourth.write_text('def f():\n    """The rows [n, hidden]."""\n' + body[0].replace("\n", "  # two\n")
                      + "    # a line of its own\n" + "".join(body[1:]))
    assert code_lines(third)[:2] == [("def f():", 1), ("y0 = g(0)", 4)]  # no docstring, no comment
    assert repeated_blocks([third, fourth], tmp_path) == [("c.py:1", "d.py:1")]


def test_no_repeated_blocks() -> None:
    pairs = repeated_blocks(sorted(ROOT.rglob("*.py")), ROOT.parent)
    assert not pairs, f"blocks of {MIN_BLOCK}+ lines written twice:\n" + "\n".join(f"{a} ~ {b}" for a, b in pairs)


def test_the_package_and_its_command_line_import_without_torch_or_transformers():
    # `import specdec`, `specdec --help`, `specdec models` and the CLI's error paths take a fraction of a
    # second only while nothing on their path imports torch (a second) or transformers' models (more)
    import subprocess
    import sys

    # and `specdec serve` checks its models' names before it listens, without them (it answers in half a second)
    code = ("import sys, specdec, specdec.cli, specdec.request, specdec.head.manifest; "
            "from specdec.serve.replicas import EngineSpec; from specdec.runtime.loading import check_config; "
            "check_config(EngineSpec('qwen2.5-coder-1.5b', 'auto')); "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "assert not heavy, heavy; specdec.SamplingParams; assert 'torch' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function or method in `path` longer than `limit` lines whose first
    line (its first decorator's where it has some) has no comment line right above it that says why it
    reads better whole (a comment with "whole" in it)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        above = lines[first - 2].strip() if first > 1 else ""
        if length > limit and not (above.startswith("#") and "whole" in above.lower()):
            found.append((node.name, node.lineno, length))
    return found


def test_long_functions_found(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    source = tmp_path / "m.py"
    source.write_text(f"def short():\n{body}\n\n# reads better whole: one table\n@decorated\ndef said():\n{body}\n"
                      f"\n# a comment that gives no reason\ndef unsaid():\n{body}\nclass C:\n    def method(self):\n"
                      + body.replace("    ", "        "))
    # "said" has its reason above its decorator; the comment above "unsaid" gives none
    assert long_functions(source, limit=4) == [("short", 1, 5), ("unsaid", 18, 5), ("method", 25, 5)]
    assert long_functions(source, limit=5) == []


def test_no_long_function_without_a_reason() -> None:
    long = [f"{path.relative_to(ROOT.parent)}:{line} {name} ({length} lines)"
            for path in sorted(ROOT.rglob("*.py")) for name, line, length in long_functions(path)
            if f"{path.relative_to(ROOT)}:{name}" not in LONG_EXEMPT]
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines: split them into well-named helpers, or say "
                      "in a comment line right above one why it reads better whole:\n" + "\n".join(long))


# Where a runner's class may be tested (isinstance, issubclass, type()): in the runners' own packages and in the
# registry, which answers for them everywhere else (specdec.runtime.runners: of, batchable, step_bytes, as_runner).
RUNNER_HOMES = ("specdec/backends/", "specdec/native/", "specdec/runtime/runners.py")


def runner_classes() -> set[str]:
    """The package's runner classes: every class whose name ends in "Runner", the protocol (ModelRunner) aside."""
    return {node.name for path in ROOT.rglob("*.py") for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ClassDef) and node.name.endswith("Runner") and node.name != "ModelRunner"}


def class_tests(path: Path, classes: set[str]) -> list[tuple[int, str]]:
    """(line, class) of each isinstance / issubclass call in `path` that names one of `classes` (alone, in a
    tuple, or as an attribute: module.Class)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass") \
                and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for kind in kinds:
                name = kind.attr if isinstance(kind, ast.Attribute) else getattr(kind, "id", "")
                if name in classes:
                    found.append((node.lineno, name))
    return found


def test_class_tests_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("if isinstance(r, (int, LeanRunner)) or isinstance(r, m.HFRunner) or isinstance(r, str):\n"
                      "    pass\n")
    assert class_tests(source, {"LeanRunner", "HFRunner"}) == [(1, "LeanRunner"), (1, "HFRunner")]


def test_no_runner_class_is_tested_outside_its_home_and_the_registry() -> None:
    classes = runner_classes()
    assert {"LeanRunner", "GGUFRunner", "HFRunner", "LlamaCppRunner", "Seq2SeqRunner"} <= classes
    found = [f"{path.relative_to(ROOT.parent)}:{line} {name}" for path in sorted(ROOT.rglob("*.py"))
             if not str(path.relative_to(ROOT.parent)).startswith(RUNNER_HOMES)
             for line, name in class_tests(path, classes)
             if not name.startswith("Stairs") or path.name != "stairs.py"]  # a stairs view is its module's own
    assert not found, "ask specdec.runtime.runners (or a runner's Capabilities), not its class:\n" + "\n".join(found)


# The --backend values are spelt once, where the flags are parsed (specdec/engine_config.py: HF, LLAMACPP; the
# registry and everyone else say the constants); zoo.py's "hf" is a folder's name.
BACKEND_NAMES = ("hf", "llamacpp")
BACKEND_SPELT = {"engine_config.py": BACKEND_NAMES, "zoo.py": ("hf",)}


def spelt_backends(path: Path) -> list[tuple[int, str]]:
    """(line, value) of each string constant in `path` that is a backend's name (docstrings aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in BACKEND_NAMES and id(node) not in docs]


def test_spelt_backends_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text('"""Runs on "hf"."""\nif backend == "hf" or x in ("llamacpp", "hf-auto"):\n    pass\n')
    assert spelt_backends(source) == [(2, "hf"), (2, "llamacpp")]


def test_the_backends_are_spelt_in_one_place() -> None:
    found = [f"{path.relative_to(ROOT.parent)}:{line} {value!r}" for path in sorted(ROOT.rglob("*.py"))
             for line, value in spelt_backends(path)
             if value not in BACKEND_SPELT.get(str(path.relative_to(ROOT)), ())]
    assert not found, "say specdec.engine_config.HF / LLAMACPP:\n" + "\n".join(found)
