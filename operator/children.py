"""Applying rendered objects: create what is missing, patch what drifted, leave the rest alone.

Sits between the pure renderers and the API (``kube.KubeApi``): the handlers pass the
desired objects here. Drift is judged by :func:`is_subset`, so fields the API server
fills in (defaults, status, uid) never count as drift and an unchanged resync sends no
write at all.
"""

from __future__ import annotations

from typing import Any, Protocol

from .renderers import Obj


class ChildApi(Protocol):
    """The few calls applying needs; ``kube.KubeApi`` is the real one."""

    def get(self, kind: str, namespace: str, name: str) -> Obj | None: ...

    def create(self, obj: Obj) -> Obj: ...

    def patch(self, kind: str, namespace: str, name: str, ops: list[Obj]) -> Obj: ...


# Invariant: is_subset(d, a) holds iff every key of every dict in d is in the matching dict
# of a with a subset value, and every list in d has a's length with subset items; so an
# object the server defaulted still contains what was rendered, and nothing else matters.
def is_subset(desired: Any, actual: Any) -> bool:
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and is_subset(v, actual[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return bool(desired == actual)


def _pointer(*parts: str) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def drift_patch(desired: Obj, actual: Obj) -> list[Obj]:
    """A JSON patch taking ``actual`` to ``desired`` in what the operator owns.

    ``spec`` is replaced whole (the server re-applies its defaults), owner references too;
    labels and annotations are set key by key, so keys others added survive."""
    ops: list[Obj] = []
    meta, have = desired.get("metadata", {}), actual.get("metadata", {})
    for section in ("labels", "annotations"):
        wanted: dict[str, str] = meta.get(section, {})
        present: dict[str, str] = have.get(section) or {}
        if wanted and not present:
            ops.append({"op": "add", "path": _pointer("metadata", section), "value": dict(wanted)})
            continue
        for key, value in wanted.items():
            if present.get(key) != value:
                ops.append({"op": "add", "path": _pointer("metadata", section, key), "value": value})
    if "ownerReferences" in meta and not is_subset(meta["ownerReferences"], have.get("ownerReferences")):
        ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": meta["ownerReferences"]})
    if not is_subset(desired.get("spec"), actual.get("spec")):
        ops.append({"op": "add", "path": "/spec", "value": desired["spec"]})
    return ops


def apply(api: ChildApi, desired: Obj) -> tuple[Obj, bool]:
    """Make the object exist as rendered; returns the object as the server has it and whether it wrote."""
    meta = desired["metadata"]
    actual = api.get(desired["kind"], meta["namespace"], meta["name"])
    if actual is None:
        return api.create(desired), True
    ops = drift_patch(desired, actual)
    if not ops:
        return actual, False
    return api.patch(desired["kind"], meta["namespace"], meta["name"], ops), True


def owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []) or [])


class NotOwnedError(Exception):
    """An object of the rendered name exists but belongs to someone else: never take it over."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"a {kind} named {name!r} exists and is not owned by this InferenceService")
