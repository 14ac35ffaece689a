"""Print the requirements of kvfleet's extras, read from pyproject.toml: the images install their
dependencies in a layer before the source, so a code change rebuilds one thin layer.

    python3 images/requirements.py pyproject.toml [EXTRA ...] > requirements.txt

The base dependencies (the torch-free control plane) always; then each extra, following extras
that name kvfleet itself (``kvfleet[engine]``). Standard library only (Python >= 3.11).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

SELF = re.compile(r"^kvfleet\[([^\]]+)\]\s*$")


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = list(project["dependencies"])
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"requirements.py: pyproject.toml has no extra {extra!r}")
        seen.add(extra)
        for req in optional[extra]:
            if match := SELF.match(req):
                todo += [e.strip() for e in match.group(1).split(",")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[1]), sys.argv[2:])))
