"""Where kvfleet keeps what it builds or fetches once per machine: torch-free, imported by the tiny
model, the downloads, the GGUF conversion and the native kernels' build (``kernels/native/build.py``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVFLEET_CACHE``, else ``~/.cache/kvfleet``."""
    env = os.environ.get("KVFLEET_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvfleet"
