"""The repository's shape (issue #27): every committed benchmark result is cited somewhere. The size
rule for Python files and functions is tests/test_size_rule.py (issue #44)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Where a result must be cited (issue #27): the README or the docs, which say what it measured.
CITING = ("README.md", "docs")
CITING_SUFFIXES = {".md", ".py", ".sh", ".c", ".h"}
SKIPPED_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}


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
