"""Where an InferenceService's engine finds its weights and adapters: ``pvc://``, ``hf://`` and ``file://``
URIs turned into the path the engine is given, the volumes and mounts it needs, and what an init
container downloads first. Pure functions of the spec; :mod:`kvfleet.operator.renderers` builds the
pod from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spec import InferenceServiceSpec

MODEL_MOUNT = "/models"
ADAPTER_MOUNT = "/adapters"  # pvc:// claims under /adapters/pvc-<i>, hf:// downloads under /adapters/hf
ADAPTER_HF_VOLUME = "adapters-hf"

Obj = dict[str, Any]


@dataclass(frozen=True)
class ModelSource:
    """Where the engine finds the weights: ``--model`` path, plus the volume and fetcher it needs."""

    path: str
    volume: Obj | None = None
    fetch_repo: str | None = None
    fetch_revision: str | None = None
    fetch_file: str | None = None  # one .gguf file of the repo, not the whole snapshot


def model_source(uri: str) -> ModelSource:
    """``pvc://claim/sub/path`` mounts the claim read-only; ``hf://org/name[@rev]`` downloads
    into an emptyDir before the engine starts (``hf://org/name/dir/file.gguf`` just that file);
    ``file:///path`` is a path already in the image. The path may name a folder or a .gguf file."""
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://") :].partition("/")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return ModelSource(path=f"{MODEL_MOUNT}/{sub}".rstrip("/"), volume=volume)
    if uri.startswith("hf://"):
        location, _, revision = uri[len("hf://") :].partition("@")
        org, name, *rest = location.split("/")
        repo, file = f"{org}/{name}", "/".join(rest) or None
        return ModelSource(
            path="/".join(p for p in (MODEL_MOUNT, repo, file) if p),
            volume={"name": "model", "emptyDir": {}},
            fetch_repo=repo,
            fetch_revision=revision or None,
            fetch_file=file,
        )
    return ModelSource(path=uri[len("file://") :])


@dataclass(frozen=True)
class AdapterSources:
    """Where the engine finds each adapter (``--lora-modules NAME=PATH``), the volumes they need, and
    the ``hf://`` ones to download first: (name, repo, revision, subfolder)."""

    paths: tuple[tuple[str, str], ...]
    volumes: tuple[Obj, ...]
    mounts: tuple[Obj, ...]
    fetches: tuple[tuple[str, str, str | None, str | None], ...]


def adapter_sources(spec: InferenceServiceSpec) -> AdapterSources:
    # Invariant: one read-only volume per distinct pvc:// claim, one emptyDir for every hf:// adapter
    # (each downloaded into /adapters/hf/<name>), and file:// paths as they are.
    claims: dict[str, str] = {}
    paths: list[tuple[str, str]] = []
    fetches: list[tuple[str, str, str | None, str | None]] = []
    for adapter in spec.adapters:
        uri = adapter.uri
        if uri.startswith("pvc://"):
            claim, _, sub = uri[len("pvc://") :].partition("/")
            volume = claims.setdefault(claim, f"adapters-pvc-{len(claims)}")
            paths.append((adapter.name, f"{ADAPTER_MOUNT}/{volume}/{sub}".rstrip("/")))
        elif uri.startswith("hf://"):
            location, _, revision = uri[len("hf://") :].partition("@")
            org, name, *rest = location.split("/")
            folder = "/".join(rest) or None
            fetches.append((adapter.name, f"{org}/{name}", revision or None, folder))
            local = f"{ADAPTER_MOUNT}/hf/{adapter.name}"
            paths.append((adapter.name, f"{local}/{folder}" if folder else local))
        else:
            paths.append((adapter.name, uri[len("file://") :]))
    volumes: list[Obj] = [
        {"name": v, "persistentVolumeClaim": {"claimName": c, "readOnly": True}} for c, v in claims.items()
    ]
    mounts: list[Obj] = [
        {"name": v, "mountPath": f"{ADAPTER_MOUNT}/{v}", "readOnly": True} for v in claims.values()
    ]
    if fetches:
        volumes.append({"name": ADAPTER_HF_VOLUME, "emptyDir": {}})
        mounts.append({"name": ADAPTER_HF_VOLUME, "mountPath": f"{ADAPTER_MOUNT}/hf", "readOnly": True})
    return AdapterSources(tuple(paths), tuple(volumes), tuple(mounts), tuple(fetches))
