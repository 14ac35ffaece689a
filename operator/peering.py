"""The peering object kopf's replicas agree through, checked before the operator starts (docs/architecture.md §7).

Where it sits: :func:`kvfleet.operator.runtime.operate` calls :func:`ensure_peering` before
it starts kopf. kopf told to peer through an object that does not exist never resumes and
never says why: the operator would do nothing at all. So a missing ``ClusterKopfPeering``
(``--all-namespaces``) or ``KopfPeering`` (each ``--namespace``) is created when RBAC allows
it (the chart ships them and grants no create: the chart's objects are expected), and
otherwise the operator acts alone, as with ``--standalone``, after a WARNING that names the
missing object.

Invariant: after :func:`ensure_peering`, either every peering object the configuration names
exists, or the returned configuration is standalone; never a silent no-op.
"""

from __future__ import annotations

import logging

import kopf

from .config import OperatorConfig
from .kube import ApiError, KubeApi

log = logging.getLogger(__name__)

PEERING_API = "/apis/kopf.dev/v1"


def _wanted(config: OperatorConfig) -> list[tuple[str, str | None]]:
    """(kind, namespace) of each peering object the configuration peers through."""
    if config.all_namespaces:
        return [("ClusterKopfPeering", None)]
    return [("KopfPeering", ns) for ns in config.namespaces]


def _collection(kind: str, namespace: str | None) -> str:
    plural = kind.lower() + "s"
    return f"{PEERING_API}/namespaces/{namespace}/{plural}" if namespace else f"{PEERING_API}/{plural}"


def _describe(kind: str, name: str, namespace: str | None) -> str:
    return f"{kind} {name!r}" + (f" in namespace {namespace!r}" if namespace else "")


def _exists(api: KubeApi, path: str, name: str) -> bool:
    # a list, not a get: the chart grants kopf's peering verbs (list, watch, patch) only
    found = api.request("GET", path) or {}
    return any((item.get("metadata") or {}).get("name") == name for item in found.get("items") or [])


def _missing_or_created(api: KubeApi, kind: str, name: str, namespace: str | None) -> str | None:
    """None when the object exists (or was just created, by this replica or another); else why not."""
    path = _collection(kind, namespace)
    try:
        if _exists(api, path, name):
            return None
        body = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": name}}
        try:
            api.request("POST", path, body)
        except (ApiError, kopf.TemporaryError):
            if _exists(api, path, name):  # another replica created it first (409)
                return None
            raise
    except (ApiError, kopf.TemporaryError) as err:
        return str(err)
    log.info("created the %s for the operator's replicas to agree through", _describe(kind, name, namespace))
    return None


def ensure_peering(api: KubeApi, config: OperatorConfig) -> OperatorConfig:
    """The configuration to run: as given when its peering objects exist or could be created, else standalone."""
    if config.standalone:
        return config
    for kind, namespace in _wanted(config):
        why = _missing_or_created(api, kind, config.peering_name, namespace)
        if why is not None:
            log.warning(
                "the %s does not exist and could not be created (%s): acting alone, as with --standalone. "
                "Run a single replica, or create the object (the Helm chart does) and restart",
                _describe(kind, config.peering_name, namespace),
                why,
            )
            return config.model_copy(update={"standalone": True})
    return config
