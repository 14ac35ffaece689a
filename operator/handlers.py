"""The kopf handlers: thin glue from kopf's causes to ``reconcile`` (docs/architecture.md §7).

``register`` puts them into a given registry so tests and ``kvfleet operator`` run the
same handlers on their own registries. Handlers are sync: kopf runs them in its thread
pool, which suits the official blocking ``kubernetes`` client.

- InferenceService create/update/resume → children + status; kopf's diff excludes status,
  so status-only changes never re-render children.
- InferenceService delete → children deleted (they also carry owner references).
- engine Deployment events → the owner's status (and re-creation if it was deleted).
- TenantQuota create/update/resume → the Valid condition.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, cast

import kopf

from kvfleet import protocol
from kvfleet.kubeconfig import client_configuration

from . import reconcile
from .config import OperatorConfig
from .kube import KubeApi, api_client, backoff_seconds, connection_info

log = logging.getLogger(__name__)

ISVC = (protocol.API_GROUP, protocol.API_VERSION, protocol.INFERENCESERVICE_PLURAL)
TQ = (protocol.API_GROUP, protocol.API_VERSION, protocol.TENANTQUOTA_PLURAL)
DEPLOYMENTS = ("apps", "v1", "deployments")


def _report(outcome: reconcile.Outcome, body: Any, retry: int) -> None:
    """A Warning event when a condition just went bad; a retry with backoff when it may heal."""
    if outcome.warning is not None:
        reason, message = outcome.warning
        kopf.warn(body, reason=reason, message=message)
    if outcome.retry is not None:
        raise kopf.TemporaryError(outcome.retry, delay=backoff_seconds(retry))


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler of the operator into ``registry``."""
    cfg = client_configuration()
    client = api_client(cfg)

    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(cfg)

    # One lock per InferenceService around every read-decide-write of its status: the
    # InferenceService handler and the Deployment event handler run in different threads,
    # and the later writer must be the one that read the Deployment last.
    locks: collections.defaultdict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)

    def reconcile_isvc(body: kopf.Body, retry: int, **_: Any) -> None:
        namespace, name = body.metadata.namespace or "", body.metadata.name or ""
        api = KubeApi(client, retry)
        with locks[namespace, name]:
            fresh = api.get_custom(
                protocol.INFERENCESERVICE_PLURAL, namespace, name
            )  # the status as stored now
            if fresh is None:
                return
            outcome = reconcile.sync_inferenceservice(api, config, fresh, apply_children=True)
        _report(outcome, fresh, retry)

    def delete_isvc(body: kopf.Body, retry: int, **_: Any) -> None:
        deleted = reconcile.delete_children(KubeApi(client, retry), body)
        log.info("deleted %s of %s/%s", deleted, body.metadata.namespace, body.metadata.name)

    def deployment_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        name = body.metadata.labels.get(protocol.LABEL_INFERENCESERVICE)
        namespace = body.metadata.namespace
        if not name or not namespace:
            return
        api = KubeApi(client)
        with locks[namespace, name]:
            isvc = api.get_custom(protocol.INFERENCESERVICE_PLURAL, namespace, name)
            if isvc is None or isvc["metadata"].get("deletionTimestamp"):
                return
            outcome = reconcile.sync_inferenceservice(
                api, config, isvc, apply_children=event.get("type") == "DELETED"
            )
        if outcome.warning is not None:
            kopf.warn(
                kopf.Body(cast(kopf.RawBody, isvc)), reason=outcome.warning[0], message=outcome.warning[1]
            )

    def validate_tq(body: kopf.Body, retry: int, **_: Any) -> None:
        _report(reconcile.sync_tenantquota(KubeApi(client, retry), body), body, retry)

    kopf.on.login(registry=registry)(login)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(*ISVC, registry=registry, id="reconcile")(reconcile_isvc)
        on(*TQ, registry=registry, id="validate")(validate_tq)
    kopf.on.delete(*ISVC, registry=registry, id="delete-children")(delete_isvc)
    kopf.on.event(
        *DEPLOYMENTS,
        labels={protocol.LABEL_APP: protocol.LABEL_APP_ENGINE},
        registry=registry,
        id="engine-status",
    )(deployment_event)
