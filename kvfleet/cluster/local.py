"""A local kvfleet cluster: the real control plane, a process node, kwok's fake GPU node, and kvfleet
installed on it as a user installs it (``kubectl apply --server-side -f crds/``, ``helm install``).

Where it sits: the top of ``kvfleet.cluster``, behind ``make cluster-up`` / ``make cluster-down``
(``python -m kvfleet.cluster up|down``) and the e2e tests of ``e2e/cluster/``. The order:

1. :func:`.controlplane.start`: etcd, kube-apiserver, kube-controller-manager, kube-scheduler;
2. the process node (:mod:`.kubelet`): pods become local processes, each on a loopback address of
   its own, the images' baked paths (``/opt/kvfleet/models``) mapped to :data:`models folder`;
3. kwok for the fake nodes (``type=kwok``): one GPU node, so GPU InferenceServices schedule;
4. the CRDs, then ``helm install`` of ``charts/kvfleet`` (operator and router as pods).

Everything started is recorded in ``STATE/cluster.json`` so ``down`` stops it from another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfleet.oslib import free_port

from . import binaries, controlplane
from .procs import Proc, stop_all, wait_until

REPO = Path(__file__).resolve().parents[2]
NODE_NAME = "kvfleet-process"
NAMESPACE = "kvfleet"
RELEASE = "kvfleet"
GPU_NODE = "kwok-gpu-0"
BIN_DIR = Path(sys.executable).parent
DEFAULT_MODELS = ("tiny",)
KWOK_STAGES = Path(__file__).with_name("kwok-stages.yaml")


@dataclass
class Cluster:
    """A running local cluster: its control plane and what was started on top."""

    cp: controlplane.ControlPlane
    bins: binaries.Binaries
    procs: list[Proc] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.cp.kubeconfig

    @property
    def state(self) -> Path:
        return self.cp.state

    def env(self) -> dict[str, str]:
        """This process's environment with KUBECONFIG, and kubectl and helm first on PATH."""
        path = os.pathsep.join(
            [str(self.bins.kubectl.parent), str(self.bins.helm.parent), os.environ["PATH"]]
        )
        return os.environ | {"KUBECONFIG": str(self.kubeconfig), "PATH": path}

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> str:
        return self._run([str(self.bins.kubectl), *args], stdin, check, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return self._run([str(self.bins.helm), *args], None, check, timeout)

    def _run(self, argv: Sequence[str], stdin: str | None, check: bool, timeout: float) -> str:
        done = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env(),
            cwd=REPO,  # the README's commands name crds/, charts/ and examples/ from the repository root
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} … failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done.stdout if check else done.stdout + done.stderr

    def kubelet_log(self, pod: dict[str, Any], container: str) -> str:
        """What a container of a pod on the process node wrote (``kubectl logs`` needs a kubelet API)."""
        meta = pod["metadata"]
        folder = self.state / "node" / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        path = folder / f"{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        stop_all(self.procs, grace=30)
        self.procs.clear()
        self.cp.stop()


def load_yaml(path: Path) -> dict[str, Any]:
    """The one object of a manifest file, as a dict to edit."""
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), path
    return loaded


def models_folder(names: Sequence[str] = DEFAULT_MODELS) -> Path:
    """The local stand-in for the engine image's ``/opt/kvfleet/models``, baked as the image bakes it."""
    cache = Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))
    dest = cache / "cluster-models"
    missing = [n for n in names if not (dest / n).is_dir()]
    if missing:
        dest.mkdir(parents=True, exist_ok=True)
        bake = [sys.executable, str(REPO / "images" / "bake_models.py"), str(dest), *missing]
        subprocess.run(bake, check=True, timeout=1800)
    return dest


def start_nodes(cluster: Cluster, models: Sequence[str]) -> None:
    """The process node (our kubelet) and kwok with its fake GPU node."""
    state, logs = cluster.state, cluster.state / "logs"
    kubelet = [
        sys.executable, "-m", "kvfleet.cluster.kubelet", "--kubeconfig", str(cluster.kubeconfig),
        "--node-name", NODE_NAME, "--state-dir", str(state / "node"), "--bin-dir", str(BIN_DIR),
        "--path-map", f"/opt/kvfleet/models={models_folder(models)}",
    ]  # fmt: skip
    cluster.procs.append(Proc.start("kubelet", kubelet, logs))
    kwok = [
        str(cluster.bins.kwok), "--kubeconfig", str(cluster.kubeconfig), "--manage-nodes-with-label-selector",
        "type=kwok", "--node-lease-duration-seconds", "40", "--config", str(KWOK_STAGES), "--server-address", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    cluster.procs.append(Proc.start("kwok", kwok, logs))
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(gpu_node(GPU_NODE)))
    wait_until(lambda: nodes_ready(cluster, [NODE_NAME, GPU_NODE]), 120, "the nodes Ready", cluster.procs)


def nodes_ready(cluster: Cluster, names: Sequence[str]) -> bool:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json"))["items"]
    ready = {
        n["metadata"]["name"]
        for n in nodes
        for c in n.get("status", {}).get("conditions", [])
        if c["type"] == "Ready" and c["status"] == "True"
    }
    return set(names) <= ready


def widen_gpu_node(cluster: Cluster, gpus: int) -> None:
    """Give the fake GPU node ``gpus`` GPUs (a benchmark's many one-GPU engines)."""
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(gpu_node(GPU_NODE, gpus)))


def gpu_node(name: str, gpus: int = 8) -> dict[str, object]:
    """A kwok node with GPUs: pods placed on it are run by kwok's stages (Running, never executed)."""
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.product": "NVIDIA-H100",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake"},
        },
        "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


# The README's "Kubernetes quick start", word for word (e2e/cluster checks the README against it).
INSTALL_CRDS = ("kubectl", "apply", "--server-side", "-f", "crds/")
INSTALL_CHART = (
    "helm",
    "install",
    RELEASE,
    "charts/kvfleet",
    "-n",
    NAMESPACE,
    "--create-namespace",
    "--wait",
)


def install_kvfleet(cluster: Cluster, extra: Sequence[str] = ()) -> None:
    """What the README's Kubernetes quick start runs: the CRDs server-side, then the chart."""
    cluster.kubectl(*INSTALL_CRDS[1:])
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    cluster.helm(*INSTALL_CHART[1:], "--timeout", "5m", *extra)


def up(state: Path, *, models: Sequence[str] = DEFAULT_MODELS, install: bool = True) -> Cluster:
    """Start the whole local cluster; on failure everything started so far is stopped."""
    bins = binaries.ensure()
    cluster = Cluster(cp=controlplane.start(state), bins=bins)
    try:
        start_nodes(cluster, models)
        if install:
            install_kvfleet(cluster)
    except BaseException:
        cluster.stop()
        raise
    record = {"pids": [p.pid for p in cluster.procs], "kubeconfig": str(cluster.kubeconfig)}
    (cluster.state / "cluster.json").write_text(json.dumps(record))
    return cluster


def down(state: Path) -> None:
    """Stop what ``up`` started (in another process): the nodes first, then the control plane."""
    record = state / "cluster.json"
    if record.exists():
        for pid in reversed(json.loads(record.read_text())["pids"]):
            controlplane.stop_pid(pid, grace=30)
        record.unlink()
    controlplane.stop_recorded(state)
