"""Pure renderers: an InferenceService's spec → the objects it should own (docs/architecture.md §7).

The kopf handlers (``handlers.py``) parse the spec, call these functions and hand the
result to ``children.apply``; nothing here talks to the API server, so every field's
effect is unit-tested on plain dicts (``tests/operator/test_renderers.py``).

Owned objects, all named after the InferenceService, all with an owner reference:
an engine ``Deployment`` (container args are the ``kvfleet engine`` flags of docs/architecture.md §3),
a ``Service`` on the engine port, a ``PodDisruptionBudget``, and a ``NetworkPolicy`` letting only the
router and the gateway in (:mod:`kvfleet.operator.network_policy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfleet.protocol import (
    API_GROUP,
    API_VERSION,
    DEFAULT_ENGINE_PORT,
    LABEL_APP,
    LABEL_APP_ENGINE,
    LABEL_ENGINE_KIND,
    LABEL_INFERENCESERVICE,
)

from .network_policy import IngressSources, render_network_policy
from .sources import (
    ADAPTER_HF_VOLUME,
    ADAPTER_MOUNT,
    MODEL_MOUNT,
    ModelSource,
    Obj,
    adapter_sources,
    model_source,
)
from .spec import InferenceServiceSpec
from .vllm_engine import is_vllm, lora_flags, shared_flags, shared_optional_flags, vllm_container_overrides

# What the kvfleet-engine images expect (images/Containerfile): a numeric non-root user, and the only
# writable paths under a read-only root: the cache ($KVFLEET_CACHE, $HOME: the tiny model, the native
# kernel's build), /tmp (the compiler's scratch files) and /dev/shm (torch's shared memory).
ENGINE_USER = 65532
CACHE_MOUNT = "/var/cache/kvfleet"
SCRATCH_VOLUMES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("cache", CACHE_MOUNT, {}),
    ("tmp", "/tmp", {}),
    ("dshm", "/dev/shm", {"medium": "Memory"}),
)
# /dev/shm of a tensor-parallel pod (spec.resources.gpus N > 1): NCCL's shared-memory transport
# between the N ranks and torch's inter-process tensors live there. vLLM's Kubernetes guide gives a
# tensor-parallel pod a memory-backed /dev/shm of sizeLimit 2Gi; the operator gives N × 2Gi (per
# GPU, as the buffers grow with the ranks; `kvfleet operator --engine-shm-per-gpu`, the chart's
# operator.engineShmPerGPU). It counts against the pod's memory limit. N <= 1: no sizeLimit, as before.
DEFAULT_SHM_PER_GPU = "2Gi"
PRESTOP_SLEEP_SECONDS = 5
ANNOTATION_SERVED_MODEL = "kvfleet.dev/served-model-name"
ENGINE_CONTAINER = "engine"


@dataclass(frozen=True)
class Owner:
    """The InferenceService the objects belong to, as the API server named it."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Obj:
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": "InferenceService",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def selector_labels(name: str) -> dict[str, str]:
    """The labels the router selects engine pods by (docs/architecture.md §7); also the immutable Deployment selector."""
    return {LABEL_APP: LABEL_APP_ENGINE, LABEL_INFERENCESERVICE: name}


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "kvfleet",
        "app.kubernetes.io/managed-by": "kvfleet-operator",
    }


def selector_string(name: str) -> str:
    """``status.selector`` for the scale subresource: ``k=v,k=v`` in a fixed order."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def endpoint(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{DEFAULT_ENGINE_PORT}"


def engine_args(spec: InferenceServiceSpec) -> list[str]:
    """The ``kvfleet engine`` flags (docs/architecture.md §3), in a fixed order; optional ones only when set."""
    eng = spec.engine
    args = [
        "--model", model_source(spec.model.uri).path,
        *shared_flags(spec),
        "--drain-timeout", str(eng.drain_seconds),
    ]  # fmt: skip
    if not eng.prefix_caching:
        args.append("--no-prefix-caching")
    args += shared_optional_flags(spec)
    if eng.attention is not None:
        args += ["--attention", eng.attention]
    if eng.simulate:
        args.append("--simulate")
    # stall-free: the floor of each step's bound, prefill filling a step up to it
    if spec.slo is not None and spec.slo.itl_p99_ms is not None:
        args += ["--target-step-ms", str(spec.slo.itl_p99_ms)]
    return args + lora_flags(spec)


def _container_resources(spec: InferenceServiceSpec) -> Obj:
    res = spec.resources
    requests: Obj = {}
    limits: Obj = {}
    if res.cpu is not None:
        requests["cpu"] = str(res.cpu)
    if res.memory is not None:
        requests["memory"] = limits["memory"] = str(res.memory)
    if res.gpus > 0:
        limits[res.gpu_resource_name] = str(res.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _probe(path: str, period: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def shm_size_limit(gpus: int, shm_per_gpu: str = DEFAULT_SHM_PER_GPU) -> str | None:
    """The /dev/shm sizeLimit of an engine pod with ``gpus`` GPUs: ``gpus`` × ``shm_per_gpu`` (a
    ``<n>Mi`` or ``<n>Gi`` quantity) when tensor parallel, else None (no limit, as before)."""
    if gpus <= 1:
        return None
    unit = shm_per_gpu[-2:]
    return f"{gpus * int(shm_per_gpu[:-2])}{unit}"


def _scratch_volumes(gpus: int, shm_per_gpu: str) -> list[Obj]:
    volumes: list[Obj] = [{"name": name, "emptyDir": dict(empty)} for name, _, empty in SCRATCH_VOLUMES]
    if (limit := shm_size_limit(gpus, shm_per_gpu)) is not None:
        volumes[-1]["emptyDir"]["sizeLimit"] = limit
    return volumes


def _scratch_mounts() -> list[Obj]:
    return [{"name": name, "mountPath": path} for name, path, _ in SCRATCH_VOLUMES]


def _engine_container(spec: InferenceServiceSpec, image: str, source: ModelSource) -> Obj:
    container: Obj = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "command": ["kvfleet", "engine"],
        "args": engine_args(spec),
        "ports": [{"name": "http", "containerPort": DEFAULT_ENGINE_PORT, "protocol": "TCP"}],
        "startupProbe": _probe("/health", 10, 90),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security(),
        "volumeMounts": _scratch_mounts(),
    }
    if spec.engine.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    if resources := _container_resources(spec):
        container["resources"] = resources
    if source.volume is not None:
        container["volumeMounts"].append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    container["volumeMounts"] += adapter_sources(spec).mounts
    if is_vllm(spec):  # vLLM's OpenAI server instead (.vllm_engine); the rest of the pod is the same
        container.update(vllm_container_overrides(spec))
    return container


_FETCH_CODE = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3], "
    "allow_patterns=sys.argv[4:] or None)"
)


def _fetch_container(spec: InferenceServiceSpec, image: str, source: ModelSource) -> Obj:
    """An init container that downloads an ``hf://`` model with ``huggingface_hub`` (in the engine image)."""
    local_dir = f"{MODEL_MOUNT}/{source.fetch_repo}"
    patterns = [source.fetch_file] if source.fetch_file else []
    fetch = [source.fetch_repo or "", source.fetch_revision or "", local_dir, *patterns]
    return _downloader(spec, image, "fetch-model", fetch, {"name": "model", "mountPath": MODEL_MOUNT})


def _adapter_fetch_container(spec: InferenceServiceSpec, image: str, index: int) -> Obj:
    """An init container that downloads one ``hf://`` adapter (its subfolder only, if named)."""
    name, repo, revision, sub = adapter_sources(spec).fetches[index]
    fetch = [repo, revision or "", f"{ADAPTER_MOUNT}/hf/{name}", *([f"{sub}/*"] if sub else [])]
    mount = {"name": ADAPTER_HF_VOLUME, "mountPath": f"{ADAPTER_MOUNT}/hf"}
    return _downloader(spec, image, f"fetch-adapter-{index}", fetch, mount)


def _downloader(spec: InferenceServiceSpec, image: str, name: str, fetch: list[str], mount: Obj) -> Obj:
    container: Obj = {
        "name": name,
        "image": image,
        "command": ["python", "-c", _FETCH_CODE],
        "args": fetch,
        "securityContext": _container_security(),
        "volumeMounts": [*_scratch_mounts(), mount],
    }
    cred = spec.model.credentials_secret_ref
    if cred is not None:
        ref = {"secretKeyRef": {"name": cred.name, "key": cred.key}}
        container["env"] = [{"name": "HF_TOKEN", "valueFrom": ref}]
    return container


def _pod_spec(spec: InferenceServiceSpec, image: str, shm_per_gpu: str) -> Obj:
    source = model_source(spec.model.uri)
    pod: Obj = {
        "terminationGracePeriodSeconds": spec.engine.drain_seconds + PRESTOP_SLEEP_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # an engine never calls the API server
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_USER,
            "runAsGroup": ENGINE_USER,
            "fsGroup": ENGINE_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(spec, image, source)],
        "volumes": _scratch_volumes(spec.resources.gpus, shm_per_gpu),
    }
    init = [_fetch_container(spec, image, source)] if source.fetch_repo is not None else []
    adapters = adapter_sources(spec)
    init += [_adapter_fetch_container(spec, image, i) for i in range(len(adapters.fetches))]
    if init:
        pod["initContainers"] = init
    if source.volume is not None:
        pod["volumes"].append(source.volume)
    pod["volumes"] += adapters.volumes
    place = spec.placement
    if place.node_selector:
        pod["nodeSelector"] = dict(place.node_selector)
    if place.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in place.tolerations]
    if place.affinity:
        pod["affinity"] = place.affinity
    if place.priority_class_name:
        pod["priorityClassName"] = place.priority_class_name
    return pod


def _metadata(owner: Owner, spec: InferenceServiceSpec) -> Obj:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "annotations": {ANNOTATION_SERVED_MODEL: spec.model.name},
        "ownerReferences": [owner.reference()],
    }


def render_deployment(
    owner: Owner, spec: InferenceServiceSpec, image: str, shm_per_gpu: str = DEFAULT_SHM_PER_GPU
) -> Obj:
    """The engine Deployment: replicas from ``spec.replicas``; a rollout never drops below them.

    ``spec.resources.gpus`` N is the tensor-parallel size: the pod asks for N GPUs, the engine gets
    ``--tensor-parallel-size N`` and /dev/shm a sizeLimit of N × ``shm_per_gpu`` (N > 1 only)."""
    pod_annotations = {
        ANNOTATION_SERVED_MODEL: spec.model.name,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(DEFAULT_ENGINE_PORT),
        "prometheus.io/path": "/metrics",
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, spec),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": {**labels(owner.name), LABEL_ENGINE_KIND: spec.engine.kind},
                    "annotations": pod_annotations,
                },
                "spec": _pod_spec(spec, image, shm_per_gpu),
            },
        },
    }


def render_service(owner: Owner, spec: InferenceServiceSpec) -> Obj:
    port = {"name": "http", "port": DEFAULT_ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, spec),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner.name), "ports": [port]},
    }


def render_pdb(owner: Owner, spec: InferenceServiceSpec) -> Obj:
    """At most one engine pod of the service down at a time for voluntary disruptions (drains)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, spec),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }


def with_engine_env(deployment: Obj, env: Mapping[str, str]) -> Obj:
    """``deployment`` with ``env`` on its engine container (the operator's own settings, such as
    OpenTelemetry's, that no spec field carries)."""
    if env:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if container["name"] == ENGINE_CONTAINER:
                container.setdefault("env", []).extend({"name": k, "value": v} for k, v in env.items())
    return deployment


def render_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    image: str,
    sources: IngressSources | None = None,
    shm_per_gpu: str = DEFAULT_SHM_PER_GPU,
) -> list[Obj]:
    """Everything the InferenceService owns, in the order it is applied (the NetworkPolicy first, so
    that no engine pod ever runs unguarded; none when ``sources`` is None)."""
    guard = (
        []
        if sources is None
        else [render_network_policy(_metadata(owner, spec), labels(owner.name), sources)]
    )
    return [
        *guard,
        render_deployment(owner, spec, image, shm_per_gpu),
        render_service(owner, spec),
        render_pdb(owner, spec),
    ]
