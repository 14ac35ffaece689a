"""Finding the Kubernetes API server, once for the router and the operator (docs/architecture.md §7).

Where it sits: the router's ``--kubernetes`` mode (:mod:`kvfleet.router.kube`, its watches go
through ``httpx``) and the operator (:mod:`kvfleet.operator.kube`, the official client and
kopf) both start from :func:`client_configuration`: the in-cluster service account, else the
kubeconfig that ``KUBECONFIG`` names now (or ``~/.kube/config``), as every client finds it.
"""

from __future__ import annotations

import os

import kubernetes


def client_configuration() -> kubernetes.client.Configuration:
    """In-cluster service account, else the kubeconfig ``KUBECONFIG`` names now (or ~/.kube/config)."""
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG") or None  # read now: the client reads it once at import
        kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
    return cfg
