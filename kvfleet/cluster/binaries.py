"""The Go binaries of the local cluster, built from their modules by ``build.sh`` and cached by
version under ``$KVFLEET_K8S_CACHE`` (default ``~/.cache/kvfleet/k8s``) outside the repository.

Where it sits: :func:`ensure` is the first step of :mod:`.controlplane` and :mod:`.local`; the
versions are pinned in ``build.sh`` (docs/cluster.md gives the build times, cold and cached).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

BUILD_SCRIPT = Path(__file__).with_name("build.sh")
BUILD_TIMEOUT_S = 3600  # a cold build of all four modules on 2 cores takes ~15-25 minutes


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path


def _run_build(what: str) -> dict[str, Path]:
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), what],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the cluster binaries ({what}) failed:\n{done.stderr[-4000:]}")
    folders = {}
    for line in done.stdout.splitlines():
        name, sep, folder = line.partition("=")
        if sep:
            folders[name] = Path(folder)
    return folders


def built() -> Binaries | None:
    """The binaries if every one is built already (no build started), else None."""
    try:
        return ensure(build=False)
    except RuntimeError:
        return None


def ensure(*, build: bool = True) -> Binaries:
    """Every binary, building the missing ones first (minutes, once per machine and version)."""
    if not build:
        os.environ["KVFLEET_K8S_NO_BUILD"] = "1"
    try:
        folders = _run_build("all")
    finally:
        os.environ.pop("KVFLEET_K8S_NO_BUILD", None)
    k8s, etcd = folders["kubernetes"], folders["etcd"]
    return Binaries(
        etcd=etcd / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        kwok=folders["kwok"] / "kwok",
        helm=folders["helm"] / "helm",
    )
