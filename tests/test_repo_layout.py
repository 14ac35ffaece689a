"""The repository's shape (issue #27): every committed benchmark result is cited somewhere, and no
Python file outside the tests grows past the house limit of 400 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Where a result must be cited (issue #27): the README or the docs, which say what it measured.
CITING = ("README.md", "docs")
CITING_SUFFIXES = {".md", ".py", ".sh", ".c", ".h"}
SKIPPED_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
LINE_LIMIT = 400


def _files(top: Path, suffixes: set[str]) -> list[Path]:
    if top.is_file():
        return [top]
    return [
        p
        for p in top.rglob("*")
        if p.is_file() and p.suffix in suffixes and not SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts)
    ]


def _citing_text() -> str:
    files = [f for top in CITING for f in _files(ROOT / top, CITING_SUFFIXES) if RESULTS not in f.parents]
    return "\n".join(f.read_text(errors="replace") for f in files)


def test_every_file_in_bench_results_is_cited_by_the_readme_or_the_docs() -> None:
    text = _citing_text()
    uncited = sorted(
        p.name for p in RESULTS.iterdir() if p.is_file() and not p.name.startswith(".") and p.name not in text
    )
    assert uncited == [], f"bench/results files cited nowhere (cite them or delete them): {uncited}"


def test_no_python_file_outside_the_tests_passes_400_lines() -> None:
    over = {}
    for path in _files(ROOT, {".py"}):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in ("tests", "e2e"):
            continue
        lines = len(path.read_text(errors="replace").splitlines())
        if lines > LINE_LIMIT:
            over[rel] = lines
    assert over == {}, f"Python files over {LINE_LIMIT} lines: {over}"
