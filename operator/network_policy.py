"""Pure renderer of an InferenceService's NetworkPolicy: who may reach its engine pods (docs/architecture.md §7).

Called by :func:`kvfleet.operator.renderers.render_children` with the operator's
:class:`IngressSources` (its ``--router-namespace`` and ``--metrics-from`` flags, which the
chart sets). Only the router and the Envoy gateway send engines requests: an engine pod
that anyone in the cluster could reach would let a tenant bypass its quota and send any
``cache_salt``, reading another tenant's prompts from the prefix cache's timing. A
NetworkPolicy cannot tell paths apart, so whoever scrapes ``/metrics`` (Prometheus, a
value of the chart) reaches the engine port too: name it narrowly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet.protocol import LABEL_APP

# The app.kubernetes.io/name labels of the pods that may send engines requests (the chart's
# router and gateway Deployments carry them; tests/charts checks both against the chart).
ROUTER_APP = "kvfleet-router"
GATEWAY_APP = "kvfleet-gateway"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server

Obj = dict[str, Any]


@dataclass(frozen=True)
class IngressSources:
    """Where the router and the gateway run (None: any namespace), and who else may scrape metrics."""

    router_namespace: str | None = None
    metrics_from: tuple[Obj, ...] = field(default_factory=tuple)  # NetworkPolicyPeer objects

    def peers(self) -> list[Obj]:
        """The NetworkPolicyPeers allowed in: the router's and the gateway's pods, then the scrapers."""
        namespace: Obj = (
            {"matchLabels": {NAMESPACE_NAME_LABEL: self.router_namespace}} if self.router_namespace else {}
        )
        apps = {"key": LABEL_APP, "operator": "In", "values": [ROUTER_APP, GATEWAY_APP]}
        control = {"namespaceSelector": namespace, "podSelector": {"matchExpressions": [apps]}}
        return [control, *(dict(peer) for peer in self.metrics_from)]


def render_network_policy(metadata: Obj, pod_labels: dict[str, str], sources: IngressSources) -> Obj:
    """Ingress to the pods of ``pod_labels`` on their ``http`` port from ``sources`` only; egress is left open
    (an ``hf://`` model is downloaded by the pod itself)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": dict(pod_labels)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources.peers(), "ports": [{"protocol": "TCP", "port": "http"}]}],
        },
    }
