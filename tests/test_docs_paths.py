"""Every module path the prose names exists (issue #44): the docs, the README and the code's comments
and docstrings ("Where it sits: ``loader/registry.py`` calls ...") cite files and modules, and a file
that moved or went away leaves a citation that misleads whoever follows it.

What counts as a citation, to stay precise rather than noisy:

- a slash path ending in a source or data suffix (``engine/model/llama.py``, ``docs/architecture.md``,
  ``csrc/decode_layers.c``), whose first folder is a folder name of this repository (so
  ``vllm/v1/metrics/loggers.py``, ``/adapters/sql`` and ``STATE/cluster.json`` are someone else's or
  placeholders); it exists when it resolves from the root, from the citing file's folder or one of its
  parents, or as the tail of a file's path (``loader/registry.py`` written in docs/ for
  ``engine/loader/registry.py``); a path that starts ``./`` or ``../`` (a Markdown link) must resolve
  from the citing file's folder exactly; URLs are never read;
- a bare file name ending ``.py`` (``model_runner.py``), which must be some file's name;
- a dotted name of three or more parts starting ``kvfleet.``, ``engine.``, ``router.`` or
  ``operator.`` (``kvfleet.engine.loader.sources.resolve_model``): each part is a package or module,
  and the first part that is neither is defined at the top of the module before it. Two-part names
  are left alone: ``kvfleet.tenant`` (a span attribute), ``operator.replicas`` (a chart value) and
  ``engine.step`` (a method) read the same as module names.

In Python files only comments and docstrings are read, never code or other strings.
"""

from __future__ import annotations

import ast
import io
import os
import posixpath
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
SUFFIXES = "py|md|yaml|yml|txt|c|h|sh|json|toml"
SLASH_PATH = re.compile(rf"(?<![\w./~$:*<>-])((?:[\w.-]+/)+[\w.-]+\.(?:{SUFFIXES}))(?![\w/-])")
BARE_PY = re.compile(r"(?<![\w./~$:*<>-])(\w+\.py)(?![\w/-])")
DOTTED = re.compile(r"(?<![\w./-])((?:kvfleet|engine|router|operator)(?:\.[A-Za-z_]\w*){2,})(?![\w/-])")
PART_FOLDERS = {"engine": "engine", "router": "router", "operator": "operator"}


@cache
def repo_files() -> frozenset[str]:
    """Every file of the checkout, as a posix path from the root; linked folders are not entered."""
    found = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not (Path(top) / d).is_symlink()]
        rel = PurePosixPath(Path(top).relative_to(ROOT).as_posix())
        found.update(str(rel / f) if str(rel) != "." else f for f in files)
    return frozenset(found)


@cache
def repo_folders() -> frozenset[str]:
    return frozenset(str(PurePosixPath(f).parent) for f in repo_files())


@cache
def folder_names() -> frozenset[str]:
    return frozenset(part for folder in repo_folders() for part in PurePosixPath(folder).parts)


@cache
def file_names() -> frozenset[str]:
    return frozenset(PurePosixPath(f).name for f in repo_files())


def prose_of_python(source: str) -> str:
    """The comments and the module, class and function docstrings of a Python file."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    parts = [t.string for t in tokens if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def slash_path_exists(path: str, citing: str) -> bool:
    files = repo_files()
    folder = PurePosixPath(citing).parent
    if path.startswith(("./", "../")):
        return posixpath.normpath(f"{folder}/{path}") in files
    while True:
        if str(folder / path if str(folder) != "." else path) in files:
            return True
        if str(folder) == ".":
            break
        folder = folder.parent
    return any(f.endswith("/" + path) for f in files)


def module_file(parts: list[str]) -> str | None:
    base = "/".join(parts)
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in repo_files():
            return candidate
    return base if base in repo_folders() else None


@cache
def top_level_names(module: str) -> frozenset[str]:
    """What a module defines or imports at its top level (inside top-level ifs and trys too)."""
    names: set[str] = set()
    for statement in ast.parse((ROOT / module).read_text()).body:
        for node in ast.walk(statement):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def dotted_name_exists(name: str) -> bool:
    first, *rest = name.split(".")
    if first == "kvfleet" and rest and rest[0] in PART_FOLDERS:
        parts, rest = [PART_FOLDERS[rest[0]]], rest[1:]
    else:
        parts = [first]
    found = module_file(parts)
    for part in rest:
        deeper = module_file([*parts, part])
        if deeper is not None:
            parts, found = [*parts, part], deeper
            continue
        return found is not None and found.endswith(".py") and part in top_level_names(found)
    return found is not None


def citations(text: str) -> Iterator[tuple[str, str]]:
    """(kind, name) for each path or module name the text names: kind is "path", "file" or "module"."""
    for match in SLASH_PATH.finditer(text):
        first = PurePosixPath(match[1]).parts[0]
        if first in folder_names() or match[1].startswith(("./", "../")):
            yield "path", match[1]
    for match in BARE_PY.finditer(text):
        yield "file", match[1]
    for match in DOTTED.finditer(text):
        yield "module", match[1]


def missing_in(text: str, citing: str) -> list[str]:
    """The citations of ``text`` (as written in the file ``citing``) that name nothing here."""
    missing = []
    for kind, name in citations(text):
        if kind == "path":
            ok = slash_path_exists(name, citing)
        elif kind == "file":
            ok = name in file_names()
        else:
            ok = dotted_name_exists(name)
        if not ok:
            missing.append(f"{citing}: {name}")
    return sorted(set(missing))


def test_every_module_path_named_in_the_docs_and_the_readme_exists() -> None:
    docs = [f for f in repo_files() if f.endswith(".md")]
    assert "README.md" in docs and any(f.startswith("docs/") for f in docs)
    missing = [m for f in sorted(docs) for m in missing_in((ROOT / f).read_text(), f)]
    assert missing == [], "paths or modules the docs name that do not exist:\n" + "\n".join(missing)


def test_every_module_path_named_in_code_comments_and_docstrings_exists() -> None:
    sources = sorted(f for f in repo_files() if f.endswith(".py"))
    missing = [m for f in sources for m in missing_in(prose_of_python((ROOT / f).read_text()), f)]
    assert missing == [], "paths or modules the comments name that do not exist:\n" + "\n".join(missing)


def test_a_made_up_path_or_module_is_reported_and_urls_labels_and_placeholders_are_not() -> None:
    text = (
        "See engine/model/llama.py, loader/registry.py, ``llama.py``, kvfleet.engine.loader.sources.resolve_model,"
        " [a](../architecture.md), [b](../../bench/results/stall_free.txt) and engine.sched.scheduler."
        " Made up: engine/model/int8_loader.py, ``cpu_fused.py``, [c](../engine.md), [d](./router.md),"
        " kvfleet.engine.model.gone, kvfleet.engine.loader.sources.no_such_function, router.nowhere.picker.\n"
        "Not citations: https://github.com/vllm-project/vllm/blob/main/vllm/engine/metrics.py,"
        " vllm/v1/metrics/loggers.py, STATE/cluster.json, ~/.cache/kvfleet/x.txt, /adapters/sql/a.json,"
        " kvfleet.dev/engine-kind, kvfleet.tenant, operator.replicas, engine.step(), bench/<subject>/*.py."
    )
    assert missing_in(text, "docs/engine/example.md") == sorted(
        f"docs/engine/example.md: {name}"
        for name in (
            "engine/model/int8_loader.py",
            "cpu_fused.py",
            "../engine.md",
            "./router.md",
            "kvfleet.engine.model.gone",
            "kvfleet.engine.loader.sources.no_such_function",
            "router.nowhere.picker",
        )
    )


def test_a_python_file_is_read_for_its_comments_and_docstrings_only() -> None:
    source = '"""Cites engine/gone.py."""\nx = "engine/also_gone.py"  # and kernels/gone_too.py\n'
    assert missing_in(prose_of_python(source), "engine/example.py") == [
        "engine/example.py: engine/gone.py",
        "engine/example.py: kernels/gone_too.py",
    ]
