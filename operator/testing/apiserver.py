"""kmock's KubernetesEmulator, filled in where a real API server does more (docs/architecture.md §9).

kmock stores objects as given; a real server also stamps ``uid``, ``resourceVersion``,
``generation`` (bumped when the spec changes) and ``creationTimestamp``, keeps ``status``
and ``spec`` apart through the status subresource, maps the scale subresource onto
``spec.replicas``, and validates custom resources against their CRD (defaults, schema,
CEL: ``crdschema.admit``), answering 422 when they fail. :class:`ApiServer` does those
before handing the request to kmock, and :func:`serve` registers every resource kopf and
the operator touch, or kopf never starts watching.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import datetime
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts, enums, parsing

from .crdschema import admit, load_crds

logging.getLogger("celpy").setLevel(logging.WARNING)
CRDS = load_crds()
ALL_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
NAMESPACED = {
    "v1/namespaces": ("Namespace", False, ()),
    "v1/events": ("Event", True, ()),
    "v1/services": ("Service", True, ()),
    "v1/secrets": ("Secret", True, ()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, ()),
    "apps/v1/deployments": ("Deployment", True, ("status", "scale")),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, ("status",)),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, ()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
}


_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads ``/api/v1/namespaces`` as a namespace prefix with no name and fails
    (the listing kopf sends to watch namespaces); read it as the namespaces resource."""
    if path.strip("/") == "api/v1/namespaces":
        return parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


parsing.parse_path = _parse_path_with_namespaces


def _merge_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch taking ``old`` to ``new`` (None removes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    diff: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old or old[key] != value:
            diff[key] = _merge_diff(old.get(key), value)
    return diff


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """The emulator with the bookkeeping and admission of a real API server."""

    _rv: int = attrs.field(default=0, init=False)
    _faults: list[tuple[str, str, int]] = attrs.field(factory=list, init=False)
    # kmock matches each request against its payloads by scanning the whole request log, so a
    # long-lived server slows quadratically; ``keep_log`` bounds the log (a benchmark's thousands of
    # requests) and ``methods`` still counts every request by method. None keeps every request.
    keep_log: int | None = attrs.field(default=None, kw_only=True)
    methods: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)

    def fail_next(self, action: str, plural: str, status: int) -> None:
        """Answer the next ``action`` (create/update/fetch/...) on ``plural`` with ``status``, storing nothing."""
        self._faults.append((action, plural, status))

    def _inject_fault(self, request: kmock.Request) -> None:
        for fault in self._faults:
            action, plural, status = fault
            if (
                request.action == enums.action(action)
                and request.resource
                and request.resource.plural == plural
            ):
                self._faults.remove(fault)
                raise kmock.KubernetesError(status=status, reason="Injected", message=f"injected {status}")

    @property
    def requests(self) -> list[kmock.Request]:
        """Every request served so far, in order."""
        return list(self._requests)

    def _next_version(self) -> str:
        self._rv += 1
        return str(self._rv)

    def stored(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object as stored now (a copy), or None when absent or deleted."""
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _crd(self, request: kmock.Request) -> dict[str, Any] | None:
        res = request.resource
        if res is None:
            return None
        crd = CRDS.get(str(res.plural))
        return crd if crd is not None and crd["spec"]["group"] == res.group else None

    def _refuse(self, errors: list[str]) -> NoReturn:
        raise kmock.KubernetesError(status=422, reason="Invalid", message="; ".join(errors))

    def _admit_create(self, request: kmock.Request) -> None:
        obj: dict[str, Any] = request.data
        meta = obj.setdefault("metadata", {})
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            generation=1,
            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        crd = self._crd(request)
        if crd is not None:
            obj.pop("status", None)
            stored, errors = admit(crd, obj)
            if errors:
                self._refuse(errors)
            obj.update(stored)

    def _admit_update(self, request: kmock.Request) -> None:
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return  # kmock answers the 404
        old = copy.deepcopy(self._objects[key].raw)
        data: Any = request.data
        if request.subresource == "scale":
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["replicas"] = data.get("spec", {}).get("replicas")
        else:
            try:
                new = dict(dicts.patch_dict(copy.deepcopy(old), data))
            except jsonpatch.JsonPatchException as exc:  # a failed "test" op too: 422 as a real server
                self._refuse([f"the patch does not apply: {exc}"])
        if request.subresource == "status":
            new = {**old, "status": new.get("status")}
        elif "status" in self.resources[request.resource].subresources:
            new["status"] = old.get("status")
        new = {k: v for k, v in new.items() if v is not None}
        crd = self._crd(request)
        if crd is not None:
            new, errors = admit(crd, new)
            if errors:
                self._refuse(errors)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = self._next_version()
        if isinstance(data, dict):
            data.clear()
            data.update(_merge_diff(old, new))
        else:
            data[:] = [{"op": "replace", "path": "", "value": new}]

    async def _serve_list(self, request: kmock.Request) -> Any:
        """kmock's listing with the resourceVersion a watch can start from."""
        async with self._lock:
            version = str(self._rv)
        listing: Any = await super()._serve_list(request)
        listing["metadata"] = {"resourceVersion": version}
        return listing

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """A watch as a real server streams it: every change after the ``resourceVersion`` it starts
        from (objects changed since then, then the live events, subscribed under the same lock)."""
        yield b""
        assert request.resource is not None
        bus = self._buses[request.resource]

        def wanted(obj: dict[str, Any]) -> bool:
            return request.namespace is None or obj.get("metadata", {}).get("namespace") == request.namespace

        since = int(request.params.get("resourceVersion", "0") or 0)
        async with self._lock:
            mark = await bus.mark()
            present = [
                obj.raw
                for (res, _, _), obj in self._objects.items()
                if res == request.resource and not obj.deleted and wanted(obj.raw)
                if int(obj.raw.get("metadata", {}).get("resourceVersion", "0") or 0) > since
            ]
        try:
            for raw in present:
                yield {"type": "MODIFIED" if since else "ADDED", "object": raw}
            async for event in bus.stream(since=mark):
                if wanted(event.get("object", {})):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _handle(self, request: kmock.Request) -> Any:
        self.methods[request.method.value] += 1
        if self.keep_log is not None and len(self._requests) > self.keep_log:
            del self._requests[: -self.keep_log]
        self._inject_fault(request)
        if request.resource is not None and request.action == enums.action.CREATE:
            self._admit_create(request)
        elif request.resource is not None and request.action == enums.action.UPDATE:
            async with self._lock:
                self._admit_update(request)
        return await super()._handle(request)


def register(server: ApiServer) -> None:
    """Every resource of the operator, kopf and the tests, with its CRD objects stored."""
    for key, (kind, namespaced, subresources) in NAMESPACED.items():
        server.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=ALL_VERBS, subresources=set(subresources)
        )
    for plural, crd in CRDS.items():
        version = crd["spec"]["versions"][0]
        server.resources[f"{crd['spec']['group']}/{version['name']}/{plural}"] = kmock.ResourceInfo(
            kind=crd["spec"]["names"]["kind"],
            singular=crd["spec"]["names"]["singular"],
            namespaced=crd["spec"]["scope"] == "Namespaced",
            verbs=ALL_VERBS,
            subresources=set(version.get("subresources", {})),
            shortnames=set(crd["spec"]["names"].get("shortNames", [])),
        )
        server.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]] = (
            crd
        )
    server.objects["v1/namespaces", None, "default"] = {"metadata": {"name": "default"}}


def write_kubeconfig(path: Path, server: ApiServer) -> Path:
    url = str(server.url).rstrip("/")
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "emulated"}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": "default"}}
        ],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.asynccontextmanager
async def serve() -> AsyncIterator[ApiServer]:
    """An ApiServer on 127.0.0.1 with every resource registered; stopped on exit."""
    async with ApiServer() as server, kmock.Server(server):
        register(server)
        yield server
