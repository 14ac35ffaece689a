"""A user's first hour on the real control plane: ``helm install`` puts the operator and the router on
the process node with their service accounts' RBAC and nothing more; ``kubectl apply`` of the tiny
example becomes Ready through Deployment → ReplicaSet → a Pod the real scheduler placed; the official
openai client answers through the router, from the tiny model and from SmolLM2 (the model the engine
image bakes); a TenantQuota throttles its tenant within seconds."""

from __future__ import annotations

import json
import time

import openai

from kvfleet.cluster import audit as auditlog
from kvfleet.cluster import local

from .conftest import (
    KEY,
    OPERATOR_SA,
    ROUTER_SA,
    TINY,
    apply,
    condition,
    eventually,
    get,
    items,
    ready_pod_ips,
    router_url,
    tenant,
)


def test_the_operator_and_the_router_run_as_pods_of_the_process_node(installed: local.Cluster) -> None:
    pods = items(installed, "pods", "-n", local.NAMESPACE)
    by_app = {p["metadata"]["labels"]["app.kubernetes.io/name"]: p for p in pods}
    assert {"kvfleet-operator", "kvfleet-router"} <= set(by_app)
    for pod in pods:
        assert pod["spec"]["nodeName"] == local.NODE_NAME
        assert condition(pod, "Ready") == "True", pod["metadata"]["name"]
        assert pod["status"]["podIP"].startswith("127."), pod["status"]
    assert (
        len([p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/name"] == "kvfleet-operator"]) == 2
    )


def test_the_tiny_example_becomes_ready_through_a_scheduled_pod(tiny: local.Cluster) -> None:
    isvc = get(tiny, "inferenceservice", "tiny", "-n", "default")
    fits = next(c for c in isvc["status"]["conditions"] if c["type"] == "CapacityFits")
    assert (fits["status"], fits["reason"]) == ("Unknown", "NoGPUs")  # a CPU engine: no GPU memory to check
    assert (
        isvc["status"]["readyReplicas"] == 1
        and isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    )
    (pod,) = items(tiny, "pods", "-n", "default", "-l", "kvfleet.dev/inferenceservice=tiny")
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and pod["spec"]["nodeName"] == local.NODE_NAME
    columns = tiny.kubectl("get", "kis", "tiny", "-n", "default").splitlines()
    assert columns[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "STATUS", "AGE"]
    assert columns[1].split()[:5] == ["tiny", "tiny", "1", "1", "EnginesReady"], columns
    columns = tiny.kubectl(
        "get", "kis", "tiny", "-n", "default", "-o", "wide"
    ).splitlines()  # Fits: priority 1
    assert columns[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "STATUS", "FITS", "AGE"]
    assert columns[1].split()[:6] == ["tiny", "tiny", "1", "1", "EnginesReady", "Unknown"], columns


def test_the_openai_client_is_answered_through_the_router(tiny: local.Cluster) -> None:
    client = openai.OpenAI(base_url=router_url(tiny) + "/v1", api_key=KEY, max_retries=0, timeout=60)
    eventually(lambda: any(m.id == "tiny" for m in client.models.list().data), 60, "the router sees tiny")
    done = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert (
        done.choices[0].finish_reason in ("length", "stop")
        and done.usage
        and done.usage.completion_tokens > 0
    )
    streamed = client.completions.create(
        model="tiny", prompt="hello", max_tokens=8, stream=True, temperature=0
    )
    assert len([chunk for chunk in streamed if chunk.choices and chunk.choices[0].text]) >= 1


def test_smollm2_becomes_ready_and_answers_through_the_router(tiny: local.Cluster) -> None:
    """The real model the engine image bakes: the tiny example with SmolLM2's baked folder."""
    manifest = local.load_yaml(TINY)
    manifest["metadata"]["name"] = manifest["spec"]["model"]["name"] = "smollm2"
    manifest["spec"]["model"]["uri"] = "file:///opt/kvfleet/models/smollm2"
    apply(tiny, manifest)
    try:
        eventually(
            lambda: condition(get(tiny, "inferenceservice", "smollm2", "-n", "default"), "Ready") == "True",
            300,
            "InferenceService smollm2 Ready",
            pause=1,
        )
        client = openai.OpenAI(base_url=router_url(tiny) + "/v1", api_key=KEY, max_retries=0, timeout=120)
        eventually(
            lambda: any(m.id == "smollm2" for m in client.models.list().data), 60, "the router sees smollm2"
        )
        done = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (done.choices[0].message.content or ""), done
    finally:
        tiny.kubectl("delete", "kis", "smollm2", "-n", "default", "--wait=true", "--timeout=120s")


def test_a_tenantquota_applied_throttles_its_tenant_within_seconds(tiny: local.Cluster) -> None:
    for obj in tenant("slow", "sk-slow-tenant", requestsPerMinute=60000):
        tiny.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    client = openai.OpenAI(
        base_url=router_url(tiny) + "/v1", api_key="sk-slow-tenant", max_retries=0, timeout=60
    )
    ask = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    eventually(lambda: client.completions.create(**ask), 30, "the new tenant admitted")
    for obj in tenant("slow", "sk-slow-tenant", requestsPerMinute=1):
        tiny.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    applied = time.monotonic()

    def throttled() -> bool:
        try:
            client.completions.create(**ask)
        except openai.RateLimitError:
            return True
        return False

    eventually(throttled, 15, "a 429 for the throttled tenant")
    assert time.monotonic() - applied < 15
    client.with_options(api_key=KEY).completions.create(**ask)  # the other tenant is unaffected


def test_the_charts_rbac_grants_every_call_kvfleet_makes(
    tiny: local.Cluster, audit: auditlog.AuditLog
) -> None:
    events = list(audit.events())
    users = {e.user for e in events}
    assert OPERATOR_SA in users and ROUTER_SA in users, (
        "the pods did not talk to the API as their service accounts"
    )
    refused = auditlog.forbidden(events, [OPERATOR_SA, ROUTER_SA])
    assert refused == [], [f"{e.user} {e.verb} {e.resource} {e.uri}" for e in refused]


def test_engine_pods_have_their_own_addresses_and_answer_on_them(tiny: local.Cluster) -> None:
    ips = ready_pod_ips(tiny, "default", "kvfleet.dev/inferenceservice=tiny")
    assert len(ips) == 1 and ips[0].startswith("127.") and ips[0] != "127.0.0.1"


def test_the_readmes_quick_start_is_what_this_cluster_was_installed_with() -> None:
    readme = (local.REPO / "README.md").read_text()
    block = readme.split("### Kubernetes quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert commands[:3] == [
        list(local.INSTALL_CRDS),
        list(local.INSTALL_CHART),
        ["kubectl", "apply", "-f", str(TINY.relative_to(local.REPO))],
    ]
