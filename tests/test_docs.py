"""The docs stay readable and connected: README within 200 lines, with the install and test commands
CI runs; every relative link in README.md, BENCHMARKS.md and docs/ resolves to a file (and heading);
every kept benchmark run is cited, and every cited one kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
RUNS = ROOT / "benchmarks" / "runs"


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (their brackets are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for line in text.splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not checked offline


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_reads_in_one_sitting():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; topics belong in docs/"


def test_ci_runs_the_readmes_install_and_test_commands_exactly():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    marked = {line: ci[i + 1].strip() for i, line in enumerate(ci) if re.match(r"# The README's .*, exactly:$", line)}
    assert set(marked) == {"# The README's install, exactly:", "# The README's test install, exactly:",
                           "# The README's test command, exactly:"}
    [lint] = [line for line in ci if line.startswith(".venv/bin/ruff ")]
    assert lint.startswith(".venv/bin/ruff check ") and lint in readme
    [types] = [line for line in ci if line.startswith(".venv/bin/mypy ")]
    assert types == ".venv/bin/mypy specdec" and types in readme  # the whole package
    assert ".venv/bin/pip install -e '.[test]'" in marked.values()
    for command in marked.values():
        assert command in readme
    # the test install's second half, llama.cpp's build, runs too
    install = marked["# The README's test install, exactly:"]
    assert f"{install} && scripts/install-llamacpp.sh --python .venv/bin/python" in readme
    assert "scripts/install-llamacpp.sh --python .venv/bin/python" in ci


def test_kept_benchmark_runs_are_the_cited_ones():
    cited = set()
    for page in PAGES:
        cited |= set(re.findall(r"benchmarks/runs/([\w.-]+)/", page.read_text(encoding="utf-8")))
    kept = {p.name for p in RUNS.iterdir() if p.is_dir()}
    assert kept == cited, f"kept, not cited: {sorted(kept - cited)}; cited, not kept: {sorted(cited - kept)}"
    assert all((RUNS / name / "summary.md").exists() for name in kept)
