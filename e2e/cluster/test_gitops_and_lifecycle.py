"""GitOps and lifecycle on the real control plane, judged by the API server's audit log and the real
controllers: re-applying unchanged manifests makes the operator write nothing; one field changed
rolls the engines under load without losing a request; ``kubectl scale`` and the autoscaler move
replicas through ``/scale``; scale to zero and back holds the request; delete leaves no child (the
real garbage collector follows ownerReferences) and no stuck finalizer; the operator killed
mid-reconcile converges after its restart, and of its two replicas one is active."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import openai

from kvfleet.cluster import audit as auditlog
from kvfleet.cluster import local

from .conftest import KEY, OPERATOR_SA, TINY, condition, eventually, get, items, ready_pod_ips, router_url

PEERING = ("kopfpeerings", "clusterkopfpeerings")  # the replicas' lease heartbeats: not reconciling


def isvc(cluster: local.Cluster, name: str = "tiny") -> dict[str, Any]:
    return get(cluster, "inferenceservice", name, "-n", "default")


def converged(cluster: local.Cluster, name: str, replicas: int) -> bool:
    obj = isvc(cluster, name)
    status = (obj or {}).get("status") or {}
    return bool(
        obj
        and status.get("observedGeneration") == obj["metadata"]["generation"]
        and status.get("readyReplicas", 0) == replicas
        and len(ready_pod_ips(cluster, "default", f"kvfleet.dev/inferenceservice={name}")) == replicas
        and condition(obj, "Ready") == ("True" if replicas else condition(obj, "Ready"))
    )


class Load:
    """Requests one after another from a thread until stopped: how many, and every failure."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        self.done, self.failures = 0, []  # type: tuple[int, list[str]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.completions.create(model="tiny", prompt="rolling", max_tokens=4, temperature=0)
                self.done += 1
            except openai.OpenAIError as err:
                self.failures.append(repr(err))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(180)


def test_reapplying_the_same_manifests_ten_times_makes_the_operator_write_nothing(
    tiny: local.Cluster, audit: auditlog.AuditLog
) -> None:
    eventually(lambda: converged(tiny, "tiny", 1), 120, "tiny converged")
    tiny.kubectl("apply", "-f", str(TINY), "--server-side")  # its first use adds the field manager "kubectl"
    before = {
        kind: get(tiny, kind, "tiny", "-n", "default")["metadata"]["resourceVersion"]
        for kind in ("kis", "deployment")
    }
    start = audit.offset()
    for _ in range(10):  # as a GitOps controller applies (server-side apply: a PATCH each time)
        tiny.kubectl("apply", "-f", str(TINY), "--server-side")
    time.sleep(10)  # time for the operator to react, were it going to
    window = list(audit.events(start))
    writes = [e for e in auditlog.writes(window, [OPERATOR_SA]) if e.resource.split("/")[0] not in PEERING]
    assert writes == [], [f"{e.verb} {e.resource} {e.name}" for e in writes]
    after = {
        kind: get(tiny, kind, "tiny", "-n", "default")["metadata"]["resourceVersion"]
        for kind in ("kis", "deployment")
    }
    changed = [f"{e.user} {e.verb} {e.resource} {e.code}" for e in window if e.is_write and e.name == "tiny"]
    assert after == before, changed
    applied = [e for e in window if e.user == "admin" and e.resource == "inferenceservices"]
    assert len([e for e in applied if e.verb == "patch"]) == 10


def test_one_field_changed_rolls_the_engines_under_load_without_losing_a_request(tiny: local.Cluster) -> None:
    eventually(lambda: converged(tiny, "tiny", 1), 120, "tiny converged")
    (old_pod,) = items(tiny, "pods", "-n", "default", "-l", "kvfleet.dev/inferenceservice=tiny")
    with Load(router_url(tiny)) as load:
        eventually(lambda: load.done >= 3, 60, "load flowing")
        tiny.kubectl(
            "patch",
            "kis",
            "tiny",
            "-n",
            "default",
            "--type=merge",
            "-p",
            '{"spec":{"engine":{"maxNumSeqs":8}}}',
        )
        eventually(
            lambda: get(tiny, "pod", old_pod["metadata"]["name"], "-n", "default") is None,
            240,
            "old pod gone",
        )
        eventually(lambda: converged(tiny, "tiny", 1), 120, "the new engine Ready")
        served = load.done
        eventually(lambda: load.done > served + 2, 60, "load served by the new engine")
    assert load.failures == [], load.failures[:5]
    (new_pod,) = items(tiny, "pods", "-n", "default", "-l", "kvfleet.dev/inferenceservice=tiny")
    assert "--max-num-seqs" in new_pod["spec"]["containers"][0]["args"]
    args = new_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"


def test_kubectl_scale_moves_replicas_through_the_scale_subresource(tiny: local.Cluster) -> None:
    tiny.kubectl("scale", "kis", "tiny", "-n", "default", "--replicas=2")
    eventually(lambda: converged(tiny, "tiny", 2), 240, "two engines Ready")
    scale = json.loads(
        tiny.kubectl(
            "get", "--raw", "/apis/kvfleet.dev/v1alpha1/namespaces/default/inferenceservices/tiny/scale"
        )
    )
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    tiny.kubectl("scale", "kis", "tiny", "-n", "default", "--replicas=1")
    eventually(lambda: converged(tiny, "tiny", 1), 240, "back to one engine")


def test_scale_to_zero_and_back_holds_the_request(tiny: local.Cluster, audit: auditlog.AuditLog) -> None:
    installed = tiny  # its tenant's key
    manifest = local.load_yaml(TINY)
    manifest["metadata"]["name"] = "zero"
    manifest["spec"]["model"]["name"] = "zero"
    manifest["spec"]["autoscaling"] = {
        "minReplicas": 0, "maxReplicas": 1, "scaleToZero": True, "scaleDownStabilizationSeconds": 5,
    }  # fmt: skip
    installed.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    try:
        eventually(
            lambda: (isvc(installed, "zero") or {}).get("spec", {}).get("replicas") == 0, 180, "scaled to 0"
        )
        eventually(
            lambda: not items(installed, "pods", "-n", "default", "-l", "kvfleet.dev/inferenceservice=zero"),
            120,
            "no engine pod",
        )
        start = audit.offset()
        client = openai.OpenAI(
            base_url=router_url(installed) + "/v1", api_key=KEY, max_retries=0, timeout=240
        )
        done = client.completions.create(model="zero", prompt="wake up", max_tokens=4, temperature=0)
        assert done.usage and done.usage.completion_tokens > 0
        scaled = [e for e in audit.events(start) if e.resource == "inferenceservices/scale" and e.is_write]
        assert scaled and scaled[0].user == auditlog.service_account(local.NAMESPACE, "kvfleet-router")
    finally:
        installed.kubectl("delete", "kis", "zero", "-n", "default", "--wait=false")


def test_delete_leaves_no_child_and_no_finalizer_behind(installed: local.Cluster) -> None:
    manifest = local.load_yaml(TINY)
    manifest["metadata"]["name"] = "gone"
    manifest["spec"]["engine"]["simulate"] = True
    installed.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    eventually(lambda: converged(installed, "gone", 1), 180, "gone Ready")
    uid = isvc(installed, "gone")["metadata"]["uid"]
    installed.kubectl("delete", "kis", "gone", "-n", "default", "--timeout=120s")
    kinds = "deployments,replicasets,pods,services,poddisruptionbudgets,networkpolicies"

    def orphans() -> list[str]:
        found = items(installed, kinds, "-n", "default")
        return [f"{o['kind']}/{o['metadata']['name']}" for o in found if _owned_by(o, uid, installed)]

    eventually(lambda: orphans() == [] or None, 120, "the garbage collector removed every child")
    assert isvc(installed, "gone") is None


def _owned_by(obj: dict[str, Any], uid: str, cluster: local.Cluster) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    if any(r["uid"] == uid for r in refs):
        return True
    return "gone" in obj["metadata"]["name"]


def test_the_operator_killed_mid_reconcile_converges_after_restart(installed: local.Cluster) -> None:
    manifest = local.load_yaml(TINY)
    manifest["metadata"]["name"] = "crash"
    manifest["spec"]["engine"]["simulate"] = True
    active = active_operator(installed)
    installed.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    installed.kubectl(
        "delete", "pod", active, "-n", local.NAMESPACE, "--grace-period=0", "--force", "--wait=false"
    )
    try:
        eventually(lambda: converged(installed, "crash", 1), 240, "converged after the operator's restart")
        eventually(
            lambda: (
                len(ready_pod_ips(installed, local.NAMESPACE, "app.kubernetes.io/name=kvfleet-operator")) == 2
            ),
            120,
            "both replicas back",
        )
    finally:
        installed.kubectl("delete", "kis", "crash", "-n", "default", "--wait=false")


def peers_now(cluster: local.Cluster) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(active, idle) operator pods as kopf's peering sees them, once both replicas are peers (their
    POD_ID in the ClusterKopfPeering's status) of distinct priorities; the highest acts. None before."""
    pods = items(cluster, "pods", "-n", local.NAMESPACE, "-l", "app.kubernetes.io/name=kvfleet-operator")
    by_name = {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}
    peers = (get(cluster, "clusterkopfpeering", "kvfleet-operator") or {}).get("status") or {}
    live = {name: peer["priority"] for name, peer in peers.items() if name in by_name}
    if len(live) != 2 or len(set(live.values())) != 2:
        return None
    active, idle = sorted(live, key=lambda name: live[name], reverse=True)
    return by_name[active], by_name[idle]


def operator_peers(cluster: local.Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
    # a replica restarted by an earlier test re-announces itself within kopf's peering interval
    return eventually(lambda: peers_now(cluster), 90, "both operator replicas peers of distinct priorities")


def active_operator(cluster: local.Cluster) -> str:
    return str(operator_peers(cluster)[0]["metadata"]["name"])


def test_two_operator_replicas_make_one_active(installed: local.Cluster) -> None:
    selector = "app.kubernetes.io/name=kvfleet-operator"
    eventually(lambda: len(ready_pod_ips(installed, local.NAMESPACE, selector)) == 2, 120, "two replicas")
    eventually(
        lambda: (
            len((get(installed, "clusterkopfpeering", "kvfleet-operator") or {}).get("status") or {}) >= 2
        ),
        60,
        "both peers",
    )
    _, idle = operator_peers(installed)
    before = len(installed.kubelet_log(idle, "operator"))
    manifest = local.load_yaml(TINY)
    manifest["metadata"]["name"] = "peers"
    manifest["spec"]["engine"]["simulate"] = True
    installed.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    try:
        eventually(lambda: converged(installed, "peers", 1), 180, "reconciled by the active replica")
        assert operator_peers(installed)[1]["metadata"]["uid"] == idle["metadata"]["uid"]
        assert "Handler '" not in installed.kubelet_log(idle, "operator")[before:], "the idle replica acted"
    finally:
        installed.kubectl("delete", "kis", "peers", "-n", "default", "--wait=false")
