"""What images/Containerfile sets for a target: its user, entrypoint, command, ports and environment,
following the FROM chain of its stages. The chart test (tests/charts/test_images.py) checks the pods
against it without building anything; images/smoke.sh checks the built images against it.

    python3 images/stage_config.py images/Containerfile kvfleet      # prints JSON

Standard library only; it reads the instructions this Containerfile uses (FROM, USER, ENTRYPOINT,
CMD, EXPOSE, ENV, WORKDIR), not every Containerfile there is.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _env(rest: str) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(word.split("=", 1) for word in words)


def stages(text: str) -> dict[str, dict[str, Any]]:
    """Each named stage's settings, inherited from the stage it starts FROM (a base image: nothing)."""
    result: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for keyword, rest in _instructions(text):
        if keyword == "FROM":
            words = rest.split()
            parent = result.get(words[0], {})
            current = {
                "user": parent.get("user"),
                "entrypoint": parent.get("entrypoint"),
                "cmd": parent.get("cmd"),
                "ports": list(parent.get("ports", [])),
                "env": dict(parent.get("env", {})),
                "workdir": parent.get("workdir"),
            }
            if len(words) == 3 and words[1].upper() == "AS":
                result[words[2]] = current
        elif current is None:
            continue
        elif keyword == "USER":
            current["user"] = rest
        elif keyword in ("ENTRYPOINT", "CMD"):
            current[keyword.lower()] = json.loads(rest)
        elif keyword == "EXPOSE":
            current["ports"] += [int(p.split("/")[0]) for p in rest.split()]
        elif keyword == "ENV":
            current["env"].update(_env(rest))
        elif keyword == "WORKDIR":
            current["workdir"] = rest
    return result


def stage_config(containerfile: Path, target: str) -> dict[str, Any]:
    return stages(containerfile.read_text())[target]


if __name__ == "__main__":
    print(json.dumps(stage_config(Path(sys.argv[1]), sys.argv[2]), sort_keys=True))
