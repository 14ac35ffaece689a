"""A pod's spec → how the process node launches one container as a local process (issue #43).

Where it sits: pure functions, no I/O. :mod:`kvfleet.cluster.podworker` fetches what the API holds
(the pod, the Secrets and ConfigMaps its env names) and passes it here, through a ``lookup``
callable, to get a :class:`LaunchPlan` per container: the argv, the environment and the working
directory a process gets in place of the container. The image is ignored: its entrypoint
(``kvfleet`` for kvfleet's images) stands in for a missing ``command``, the environment it bakes in
(``KVFLEET_CACHE``, ``HOME``, ``PYTHONUNBUFFERED``) is set here, and a path inside the container
(a volume's ``mountPath``, or a prefix of the node's ``path_map``) is rewritten to the local folder
that holds it wherever an argument, a command word, an env value or ``workingDir`` names it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
# lookup(kind, name) → the object's data as text ("secret": base64-decoded), or None when it does not exist
Lookup = Callable[[str, str], "Mapping[str, str] | None"]

CACHE_MOUNT = "/var/cache/kvfleet"  # the images' $KVFLEET_CACHE, $HOME and WORKDIR (images/Containerfile)
TMP_MOUNT = "/tmp"
DEFAULT_ENTRYPOINT = ("kvfleet",)  # the ENTRYPOINT of kvfleet's images
_META_KEY = re.compile(r"metadata\.(labels|annotations)\['(.*)'\]")


class ConfigError(Exception):
    """A Secret, ConfigMap or key the container needs is missing (CreateContainerConfigError)."""


@dataclass(frozen=True)
class NodeSettings:
    """What the node gives every container: the venv's bin folder first on PATH, the path map, the shim."""

    bin_dir: str
    system_path: str = "/usr/local/bin:/usr/bin:/bin"
    path_map: Mapping[str, str] = field(default_factory=dict)
    shim: str | None = None  # the LD_PRELOAD bind shim (kvfleet.cluster.processes.build_shim)
    kubelet_pid: int = 0  # the shim ties a container's first process to the kubelet's life (PR_SET_PDEATHSIG)
    entrypoint: tuple[str, ...] = DEFAULT_ENTRYPOINT


@dataclass(frozen=True)
class PodFolders:
    """Where one pod's things lie on this machine."""

    volumes: Mapping[str, str]  # volume name → local folder (or file, for a hostPath file)
    home: str  # HOME / KVFLEET_CACHE / working directory when the pod mounts nothing at /var/cache/kvfleet
    kubeconfig: str | None = None  # the service account's kubeconfig, when the token is mounted


@dataclass(frozen=True)
class LaunchPlan:
    """One container as a process: what to run, with which environment, where."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$(NAME)`` → ``env[NAME]`` when defined, else left as
    written; ``$$`` → ``$``; any other ``$`` is kept."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env[name] if name in env else text[i : end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def field_ref(pod: Obj, path: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath`` of ``pod`` (its status already holds the pod IP)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(p.get("ip", "") for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p.get("ip", "") for p in status.get("hostIPs") or []),
    }
    if path in simple:
        return simple[path] or ""
    if match := _META_KEY.fullmatch(path):
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = (meta.get(path.split(".")[1]) or {}).items()
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items))
    raise ConfigError(f"unsupported fieldRef {path!r}")


def _resource_ref(container: Obj, ref: Obj) -> str:
    """``resourceFieldRef``: the container's limit (else request) as written; the divisor is ignored."""
    resources = container.get("resources") or {}
    kind, _, name = ref.get("resource", "").partition(".")
    value = (resources.get(kind) or {}).get(name) or (resources.get("requests") or {}).get(name)
    return str(value) if value is not None else "0"


def _key_ref(kind: str, ref: Obj, lookup: Lookup) -> str | None:
    data = lookup(kind, ref.get("name", ""))
    if data is not None and ref.get("key") in data:
        return data[ref["key"]]
    if ref.get("optional"):
        return None
    raise ConfigError(f"{kind} {ref.get('name')!r} or its key {ref.get('key')!r} is missing")


def _value_from(pod: Obj, container: Obj, source: Obj, lookup: Lookup) -> str | None:
    if "fieldRef" in source:
        return field_ref(pod, source["fieldRef"].get("fieldPath", ""))
    if "resourceFieldRef" in source:
        return _resource_ref(container, source["resourceFieldRef"])
    if "secretKeyRef" in source:
        return _key_ref("secret", source["secretKeyRef"], lookup)
    if "configMapKeyRef" in source:
        return _key_ref("configmap", source["configMapKeyRef"], lookup)
    raise ConfigError(f"unsupported valueFrom {sorted(source)}")


def container_env(pod: Obj, container: Obj, lookup: Lookup) -> dict[str, str]:
    """The env the pod spec defines for ``container``: ``envFrom`` first, then ``env`` in order, each
    ``value`` expanded against the variables defined before it (as Kubernetes does)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind, ref = (
            ("configmap", source["configMapRef"])
            if "configMapRef" in source
            else ("secret", source.get("secretRef") or {})
        )
        data = lookup(kind, ref.get("name", ""))
        if data is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f"{kind} {ref.get('name')!r} is missing")
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        if "valueFrom" in var:
            value = _value_from(pod, container, var["valueFrom"], lookup)
            if value is None:
                continue
        else:
            value = expand(var.get("value", ""), env)
        env[var["name"]] = value
    return env


def map_path(value: str, mapping: Mapping[str, str]) -> str:
    """``value`` with its container path rewritten to the local one: a value equal to a mapped path or
    under it (``mapped + "/..."``), or a ``--flag=PATH`` whose PATH is; the longest mapped path wins."""
    for src in sorted(mapping, key=len, reverse=True):
        if value == src or value.startswith(src + "/"):
            return mapping[src] + value[len(src) :]
    flag, eq, rest = value.partition("=")
    if eq and flag.startswith("-") and rest.startswith("/"):
        return flag + eq + map_path(rest, mapping)
    return value


def mount_map(container: Obj, folders: PodFolders, settings: NodeSettings) -> dict[str, str]:
    """Container path → local path for ``container``: the node's path map, then its volume mounts."""
    mapping = {k.rstrip("/"): v for k, v in settings.path_map.items() if k.rstrip("/")}
    for mount in container.get("volumeMounts") or []:
        local = folders.volumes.get(mount.get("name", ""))
        path = (mount.get("mountPath") or "").rstrip("/")
        if local is None or not path:
            continue
        mapping[path] = f"{local}/{mount['subPath']}" if mount.get("subPath") else local
    return mapping


def _image_env(
    pod: Obj, mapping: Mapping[str, str], folders: PodFolders, settings: NodeSettings
) -> dict[str, str]:
    """What the image and the kubelet set before the pod's own env (which overrides it)."""
    cache = mapping.get(CACHE_MOUNT, folders.home)
    env = {
        "PATH": f"{settings.bin_dir}:{settings.system_path}",
        "HOME": cache,
        "KVFLEET_CACHE": cache,
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOSTNAME": (pod.get("spec") or {}).get("hostname") or pod["metadata"]["name"],
    }
    if TMP_MOUNT in mapping:
        env["TMPDIR"] = mapping[TMP_MOUNT]
    if folders.kubeconfig:
        env["KUBECONFIG"] = folders.kubeconfig
    return env


def launch_plan(
    pod: Obj, container: Obj, lookup: Lookup, folders: PodFolders, settings: NodeSettings
) -> LaunchPlan:
    """The process for ``container`` of ``pod`` (whose ``status.podIP`` is already this pod's address)."""
    mapping = mount_map(container, folders, settings)
    pod_env = container_env(pod, container, lookup)
    command = [expand(word, pod_env) for word in container.get("command") or settings.entrypoint]
    args = [expand(word, pod_env) for word in container.get("args") or []]
    env = _image_env(pod, mapping, folders, settings)
    env.update({k: map_path(v, mapping) for k, v in pod_env.items()})
    pod_ip = (pod.get("status") or {}).get("podIP")
    if pod_ip:
        env["KVFLEET_POD_IP"] = pod_ip
    if settings.shim:
        env["LD_PRELOAD"] = " ".join(p for p in (settings.shim, pod_env.get("LD_PRELOAD")) if p)
        if settings.kubelet_pid:
            env["KVFLEET_KUBELET_PID"] = str(settings.kubelet_pid)
    working_dir = container.get("workingDir")
    cwd = map_path(working_dir, mapping) if working_dir else env["KVFLEET_CACHE"]
    return LaunchPlan(argv=[map_path(w, mapping) for w in command + args], env=env, cwd=cwd)


def restart_policy(pod: Obj, container: Obj | None = None) -> str:
    """The container's own ``restartPolicy`` (a sidecar init container's ``Always``), else the pod's."""
    if container is not None and container.get("restartPolicy"):
        return str(container["restartPolicy"])
    return str((pod.get("spec") or {}).get("restartPolicy") or "Always")


def grace_seconds(pod: Obj) -> int:
    """How long a deletion waits between SIGTERM and SIGKILL: the deletion's grace, else the spec's."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    for value in (meta.get("deletionGracePeriodSeconds"), spec.get("terminationGracePeriodSeconds")):
        if value is not None:
            return max(int(value), 0)
    return 30


def container_port(container: Obj, port: int | str) -> int:
    """A probe's ``port``: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for entry in container.get("ports") or []:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ConfigError(f"container {container.get('name')!r} has no port named {port!r}")
