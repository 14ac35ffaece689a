"""Running the operator: kopf settings from :class:`OperatorConfig` and the embedded kopf runtime.

``kvfleet operator`` calls :func:`run`; tests and the benchmark await :func:`operate` in
their own event loop with a stop flag. Several replicas agree through kopf peering
(a ``KopfPeering`` per watched namespace, or the ``ClusterKopfPeering`` with
``--all-namespaces``, both shipped in ``crds/`` and created by the chart): the replica
of the highest priority acts, the others pause until it stops renewing its lease. Without
that object the operator creates it, or acts alone after a WARNING (:mod:`.peering`).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import kopf

from kvfleet.kubeconfig import client_configuration

from .config import OperatorConfig
from .handlers import register
from .kube import KubeApi, api_client
from .peering import ensure_peering

PREFIX = "kvfleet.dev"


def settings_for(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = f"{PREFIX}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.peering.priority = config.priority
    return settings


async def operate(
    config: OperatorConfig,
    *,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
    settings: kopf.OperatorSettings | None = None,
) -> None:
    """The operator in the running event loop, until ``stop_flag`` is set."""
    config = await asyncio.to_thread(ensure_peering, KubeApi(api_client(client_configuration())), config)
    registry = kopf.OperatorRegistry()
    register(registry, config)
    await kopf.operator(
        registry=registry,
        settings=settings or settings_for(config),
        standalone=config.standalone,
        peering_name=None if config.standalone else config.peering_name,
        priority=config.priority,
        clusterwide=config.all_namespaces,
        namespaces=list(config.namespaces),
        liveness_endpoint=config.liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def run(config: OperatorConfig) -> None:
    asyncio.run(operate(config))
