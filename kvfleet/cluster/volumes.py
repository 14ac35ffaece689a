"""A pod's volumes as local folders, and its service-account tokens (issue #43).

Where it sits: :class:`kvfleet.cluster.podworker.PodWorker` calls :func:`materialise` once before
its pod's first container starts, and again for the token-bearing volumes whenever its
:class:`TokenSource` says a token is due for renewal. Each volume becomes a folder:

* ``emptyDir`` → ``<pod dir>/volumes/<name>``, empty (``medium: Memory`` too: no tmpfs);
* ``configMap``, ``secret``, ``downwardAPI``, ``projected`` → the same folder, with one file per key
  (or per ``items`` entry) written from the API objects; a projected ``serviceAccountToken`` is a
  token bound to the pod, from the TokenRequest API;
* ``hostPath`` → that path itself (created for ``DirectoryOrCreate``);
* ``persistentVolumeClaim`` → its bound PersistentVolume's ``hostPath`` / ``local`` path if it has
  one, else ``<state dir>/claims/<namespace>/<claim>``, shared by every pod naming the claim;
* anything else → an empty folder, with a warning.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kvfleet.cluster.podspec import ConfigError, field_ref

log = logging.getLogger(__name__)
Obj = dict[str, Any]
TOKEN_SECONDS = 3600
_PLURAL = {"configmap": "configmaps", "secret": "secrets"}


class Getter(Protocol):
    def get(self, path: str) -> Obj | None: ...


class TokenCreator(Getter, Protocol):
    def create(self, path: str, body: Obj) -> Obj: ...


def object_data(api: Getter, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
    """A ConfigMap's (``data`` and ``binaryData``) or a Secret's keys as bytes; None if it does not exist."""
    obj = api.get(f"/api/v1/namespaces/{namespace}/{_PLURAL[kind]}/{name}")
    if obj is None:
        return None
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    return data | {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}


class TokenSource:
    """Service-account tokens bound to one pod, one per audience, renewed once half their life is gone."""

    def __init__(self, api: TokenCreator, pod: Obj, seconds: int = TOKEN_SECONDS) -> None:
        self.api, self.pod, self.seconds = api, pod, seconds
        self._tokens: dict[
            str, tuple[str, float]
        ] = {}  # audience ("" = the API server's) → (token, renew at)

    def token(self, audience: str = "") -> str:
        cached = self._tokens.get(audience)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        meta, spec = self.pod["metadata"], self.pod.get("spec") or {}
        account = spec.get("serviceAccountName") or "default"
        body: Obj = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": self.seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        if audience:
            body["spec"]["audiences"] = [audience]
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        token = str(self.api.create(path, body)["status"]["token"])
        self._tokens[audience] = (token, time.monotonic() + self.seconds / 2)
        return token

    def due(self) -> bool:
        """Whether a token handed out is half-way to its expiry (the files holding it need rewriting)."""
        return any(time.monotonic() >= renew_at for _, renew_at in self._tokens.values())


def _keys(data: Mapping[str, bytes] | None, source: Obj, what: str) -> dict[str, bytes]:
    """The files a configMap/secret source makes: every key, or its ``items`` (key → path)."""
    if data is None:
        if source.get("optional"):
            return {}
        raise ConfigError(f"{what} is missing")
    if not source.get("items"):
        return dict(data)
    out: dict[str, bytes] = {}
    for item in source["items"]:
        if item.get("key") in data:
            out[item.get("path") or item["key"]] = data[item["key"]]
        elif not source.get("optional"):
            raise ConfigError(f"{what} has no key {item.get('key')!r}")
    return out


def _source_files(source: Obj, pod: Obj, api: Getter, tokens: TokenSource | None) -> dict[str, bytes]:
    """The files of one volume source (a volume's, or one of a projected volume's ``sources``)."""
    ns = pod["metadata"]["namespace"]
    if "configMap" in source:
        name = source["configMap"].get("name", "")
        return _keys(object_data(api, "configmap", ns, name), source["configMap"], f"configmap {name!r}")
    if "secret" in source:
        name = source["secret"].get("secretName") or source["secret"].get("name", "")
        return _keys(object_data(api, "secret", ns, name), source["secret"], f"secret {name!r}")
    if "downwardAPI" in source:
        items = source["downwardAPI"].get("items") or []
        return {
            i["path"]: field_ref(pod, i["fieldRef"]["fieldPath"]).encode() for i in items if "fieldRef" in i
        }
    if "serviceAccountToken" in source:
        if tokens is None:
            raise ConfigError("a serviceAccountToken projection without a token source")
        sat = source["serviceAccountToken"]
        return {sat.get("path", "token"): tokens.token(sat.get("audience") or "").encode()}
    return {}


def volume_files(volume: Obj, pod: Obj, api: Getter, tokens: TokenSource | None) -> dict[str, bytes] | None:
    """The files of a configMap/secret/downwardAPI/projected volume (path → bytes); None for other kinds."""
    if "projected" in volume:
        files: dict[str, bytes] = {}
        for source in volume["projected"].get("sources") or []:
            files.update(_source_files(source, pod, api, tokens))
        return files
    if any(kind in volume for kind in ("configMap", "secret", "downwardAPI")):
        return _source_files(volume, pod, api, tokens)
    return None


def write_files(folder: Path, files: Mapping[str, bytes], mode: int = 0o644) -> None:
    """Each file of ``files`` under ``folder``, replaced atomically (a reader never sees half a token)."""
    for rel, content in files.items():
        path = folder / rel
        if not path.resolve().is_relative_to(folder.resolve()):
            raise ConfigError(f"volume file path {rel!r} leaves its volume")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        os.chmod(tmp, mode)
        os.replace(tmp, path)


def claim_folder(api: Getter, state_dir: Path, namespace: str, claim: str) -> str:
    """Where a PersistentVolumeClaim's data lies here (see the module docstring)."""
    pvc = api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}") or {}
    volume_name = (pvc.get("spec") or {}).get("volumeName")
    pv = (api.get(f"/api/v1/persistentvolumes/{volume_name}") if volume_name else None) or {}
    pv_spec = pv.get("spec") or {}
    local = (pv_spec.get("hostPath") or pv_spec.get("local") or {}).get("path")
    folder = Path(local) if local else state_dir / "claims" / namespace / claim
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def materialise(
    pod: Obj,
    pod_dir: Path,
    state_dir: Path,
    api: Getter,
    tokens: TokenSource | None,
    only_tokens: bool = False,
) -> dict[str, str]:
    """Every volume of ``pod`` as a local folder (name → path), files written; with ``only_tokens``
    just the projected volumes holding a token are rewritten (and only they are returned)."""
    folders: dict[str, str] = {}
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = volume["name"]
        projected = (volume.get("projected") or {}).get("sources") or []
        if only_tokens and not any("serviceAccountToken" in s for s in projected):
            continue
        if "hostPath" in volume:
            folders[name] = volume["hostPath"]["path"]
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                Path(folders[name]).mkdir(parents=True, exist_ok=True)
            continue
        if "persistentVolumeClaim" in volume:
            folders[name] = claim_folder(
                api, state_dir, pod["metadata"]["namespace"], volume["persistentVolumeClaim"]["claimName"]
            )
            continue
        folder = pod_dir / "volumes" / name
        folder.mkdir(parents=True, exist_ok=True)
        files = volume_files(volume, pod, api, tokens)
        if files is not None:
            kind = next(k for k in ("projected", "configMap", "secret", "downwardAPI") if k in volume)
            write_files(folder, files, int(volume[kind].get("defaultMode") or 0o644))
        elif "emptyDir" not in volume:
            log.warning(
                "volume %s of %s: kind %s not supported, an empty folder stands in",
                name,
                pod["metadata"]["name"],
                sorted(volume),
            )
        folders[name] = str(folder)
    return folders
