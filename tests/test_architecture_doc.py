"""docs/architecture.md against the tree (issue 56): its layout table names every module of
every package in that package's row, and names no module that is not there, so the map a
newcomer reads first never drifts from the code."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = [
    *sorted(p for p in (REPO / "pdserve").iterdir() if (p / "__init__.py").exists()),
    REPO / "bench" / "pdserve_bench",
    REPO / "bench" / "pdserve_bench" / "chaos",
]


def _rows() -> dict[str, str]:
    """Layout table: the first cell's first path (`pdserve/api/`) -> the whole row."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2 and (m := re.match(r" `([^`]+)`", cells[1])):
            rows[m.group(1)] = line
    return rows


def _named_files(row: str) -> set[str]:
    return set(re.findall(r"`([a-z0-9_]+\.py)`", row)) | set(
        re.findall(r"\b([a-z0-9_]+\.py)\b", row)
    )


def test_every_package_row_names_its_modules_and_no_other() -> None:
    rows = _rows()
    problems = []
    for package in PACKAGES:
        key = f"{package.relative_to(REPO)}/"
        if key not in rows:
            problems.append(f"no row for {key}")
            continue
        modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
        named = set(re.findall(r"`([a-z0-9_]+\.py)`", rows[key]))
        problems += [f"{key}{m} is not named in its row" for m in sorted(modules - named)]
        problems += [f"{key} row names {m}, which is not there" for m in sorted(named - modules)]
    assert not problems, "\n".join(problems)


def test_every_top_level_module_is_named() -> None:
    text = DOC.read_text()
    missing = [
        p.name
        for p in sorted((REPO / "pdserve").glob("*.py"))
        if p.stem != "__init__" and f"`{p.stem}`" not in text and p.name not in _named_files(text)
    ]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_kernel_source_is_named_in_the_model_row() -> None:
    row = _rows()["pdserve/model/"]
    sources = sorted(p.name for p in (REPO / "pdserve" / "model" / "csrc").iterdir())
    assert [s for s in sources if f"`{s}`" not in row] == []


MAX_LINES = 500
"""A product file a reader can hold (issue 56): past it, split by what the parts do."""


def test_no_product_file_is_over_500_lines() -> None:
    files = [p for p in (REPO / "pdserve").rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    long = {
        str(p.relative_to(REPO)): n
        for p in files
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert files and long == {}
