"""kopf's real runtime with the operator's handlers against the emulated API server (docs/architecture.md §9).

A user applies manifests with the official ``kubernetes`` client; the operator runs in
its own thread as in a pod; assertions read what the API server stores.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.operator import renderers
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.spec import parse_inferenceservice
from kvfleet.operator.testing.apiserver import ApiServer, serve
from kvfleet.operator.testing.cluster import User, inferenceservice, roll_out
from kvfleet.operator.testing.harness import eventually, kubeconfig_for, running_operator, settle

ISVC = "kvfleet.dev/v1alpha1/inferenceservices"
DEPLOY = "apps/v1/deployments"
SERVICE = "v1/services"
PDB = "policy/v1/poddisruptionbudgets"
CONFIG = OperatorConfig(namespaces=("default",), standalone=True, engine_image="kvfleet:test")


class Cluster:
    def __init__(self, server: ApiServer, user: User, client: Any) -> None:
        self.server, self.user, self.client = server, user, client

    def get(self, resource: str, name: str = "llama") -> dict[str, Any] | None:
        return self.server.stored(resource, "default", name)

    def condition(self, kind: str, name: str = "llama") -> dict[str, Any] | None:
        isvc = self.get(ISVC, name) or {}
        for cond in (isvc.get("status") or {}).get("conditions", []):
            if cond["type"] == kind:
                return dict(cond)
        return None

    async def apply_and_await_children(self) -> None:
        """Apply the default InferenceService and wait until the operator has made its children."""
        await self.user.apply(inferenceservice())
        await eventually(lambda: self.get(PDB), what="the children")

    async def requests_once_quiet(self) -> int:
        """Wait until the server has been quiet for half a second; then the number of requests it saw."""
        await settle(self.server, quiet=0.5)
        return len(self.server.requests)

    def writes(self, since: int = 0) -> list[tuple[str, str]]:
        """(method, path) of every write the server saw after request number ``since``."""
        methods = [(r.method.value.upper(), r.url.path) for r in self.server.requests[since:]]
        return [(m, p) for m, p in methods if m in ("POST", "PATCH", "PUT", "DELETE")]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with serve() as server:
        with kubeconfig_for(server, tmp_path) as client:
            yield Cluster(server, User(client), client)


def rendered(cluster: Cluster, name: str = "llama") -> list[dict[str, Any]]:
    isvc = cluster.get(ISVC, name) or {}
    owner = renderers.Owner(name, "default", isvc["metadata"]["uid"])
    return renderers.render_children(owner, parse_inferenceservice(dict(isvc["spec"])), "kvfleet:test")


async def test_applying_an_inferenceservice_creates_its_deployment_service_and_pdb(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.user.apply(inferenceservice(resources={"gpus": 1}))
        await eventually(lambda: cluster.get(PDB), what="the PodDisruptionBudget")
        await eventually(lambda: cluster.condition("Progressing"), what="a status")
    for desired, resource in zip(rendered(cluster), (DEPLOY, SERVICE, PDB), strict=True):
        stored = cluster.get(resource) or {}
        assert stored["spec"] == desired["spec"]
        assert stored["metadata"]["ownerReferences"] == desired["metadata"]["ownerReferences"]
        assert stored["metadata"]["labels"]["kvfleet.dev/inferenceservice"] == "llama"
    status = (cluster.get(ISVC) or {})["status"]
    assert status["selector"] == "app.kubernetes.io/name=kvfleet-engine,kvfleet.dev/inferenceservice=llama"
    assert status["endpoint"] == "http://llama.default.svc:8000"
    assert status["observedGeneration"] == 1
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "False", "EnginesNotReady"),
        ("Progressing", "True", "RollingOut"),
        ("Degraded", "False", "AsExpected"),
        ("CapacityFits", "Unknown", "NoGPUType"),
    ]


async def test_scaling_and_changing_engine_args_patch_only_the_deployment(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.apply_and_await_children()
        before = await cluster.requests_once_quiet()
        await cluster.user.scale("llama", 3)
        await eventually(lambda: (cluster.get(DEPLOY) or {})["spec"]["replicas"] == 3, what="3 replicas")
        engine = {"maxNumSeqs": 64, "prefixCaching": False}
        await cluster.user.apply(inferenceservice(replicas=3, engine=engine))
        args = lambda: (cluster.get(DEPLOY) or {})["spec"]["template"]["spec"]["containers"][0]["args"]  # noqa: E731
        await eventually(lambda: "--no-prefix-caching" in args(), what="the new engine args")
        await settle(cluster.server)
    assert args()[args().index("--max-num-seqs") + 1] == "64"
    child_writes = [w for w in cluster.writes(before) if "/apis/kvfleet.dev/" not in w[1]]
    assert child_writes == [("PATCH", "/apis/apps/v1/namespaces/default/deployments/llama")] * 2


async def test_a_ready_deployment_makes_the_inferenceservice_ready(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.user.apply(inferenceservice())
        await eventually(lambda: cluster.get(DEPLOY), what="the Deployment")
        await roll_out(cluster.client, "llama", ready=1)
        ready = await eventually(
            lambda: (cluster.condition("Ready") or {}).get("status") == "True" and cluster.condition("Ready")
        )
        progressing = cluster.condition("Progressing") or {}
    assert (ready["reason"], ready["message"]) == ("EnginesReady", "1/1 engine pods ready")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutComplete")
    assert (cluster.get(ISVC) or {})["status"]["readyReplicas"] == 1


async def test_deleting_the_inferenceservice_deletes_its_children(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.apply_and_await_children()
        await cluster.user.delete("inferenceservices", "llama")
        await eventually(lambda: cluster.get(ISVC) is None, what="the InferenceService gone")
    assert (cluster.get(DEPLOY), cluster.get(SERVICE), cluster.get(PDB)) == (None, None, None)


async def test_a_resync_with_nothing_changed_writes_nothing(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.apply_and_await_children()
        await roll_out(cluster.client, "llama", ready=1)
        await eventually(lambda: (cluster.condition("Ready") or {}).get("status") == "True", what="Ready")
        await settle(cluster.server)
    before = len(cluster.server.requests)
    async with running_operator(CONFIG):  # a restart: kopf resumes every InferenceService
        await settle(cluster.server)
    assert cluster.writes(before) == []


async def test_status_only_changes_do_not_rerender_children(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.apply_and_await_children()
        before = await cluster.requests_once_quiet()
        await roll_out(cluster.client, "llama", ready=0)  # a Deployment status change alone
        await settle(cluster.server)
    child_writes = [w for w in cluster.writes(before) if "/inferenceservices/" not in w[1]]
    assert child_writes == [("PATCH", "/apis/apps/v1/namespaces/default/deployments/llama/status")]


@pytest.mark.parametrize("status", [409, 503])
async def test_api_conflicts_and_server_errors_are_retried(cluster: Cluster, status: int) -> None:
    cluster.server.fail_next("create", "deployments", status)
    async with running_operator(CONFIG):
        await cluster.user.apply(inferenceservice())
        await eventually(lambda: cluster.get(PDB), timeout=20, what="the children after a retry")
    posts = [w for w in cluster.writes() if w == ("POST", "/apis/apps/v1/namespaces/default/deployments")]
    assert len(posts) == 2


async def test_a_deleted_deployment_is_created_again(cluster: Cluster) -> None:
    async with running_operator(CONFIG):
        await cluster.user.apply(inferenceservice())
        uid = (await eventually(lambda: cluster.get(DEPLOY), what="the Deployment"))["metadata"]["uid"]
        await settle(cluster.server, quiet=0.5)
        path = "/apis/apps/v1/namespaces/default/deployments/llama"
        await cluster.server.delete(path)
        again = await eventually(lambda: (d := cluster.get(DEPLOY)) and d["metadata"]["uid"] != uid and d)
    assert again["spec"] == rendered(cluster)[0]["spec"]
