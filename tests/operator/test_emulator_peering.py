"""Several operator replicas: kopf peering lets only the one of the highest priority act."""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.testing.apiserver import ApiServer, serve
from kvfleet.operator.testing.cluster import User, inferenceservice
from kvfleet.operator.testing.harness import eventually, kubeconfig_for, running_operator, settle

DEPLOY = "apps/v1/deployments"
PEERING = "kopf.dev/v1/kopfpeerings"


def replica(image: str, priority: int) -> OperatorConfig:
    return OperatorConfig(namespaces=("default",), engine_image=image, priority=priority)


async def test_only_the_highest_priority_replica_acts_and_the_next_takes_over(tmp_path: Path) -> None:
    async with serve() as server:
        server.objects[PEERING, "default", "kvfleet-operator"] = {
            "metadata": {"name": "kvfleet-operator", "namespace": "default"}
        }

        def peers() -> int:
            return len((server.stored(PEERING, "default", "kvfleet-operator") or {}).get("status") or {})

        with kubeconfig_for(server, tmp_path) as client:
            user = User(client)
            async with contextlib.AsyncExitStack() as standby_stack:
                leader = running_operator(replica("leader:1", priority=20))
                await leader.__aenter__()
                try:
                    await eventually(lambda: peers() == 1, what="the leader in the peering")
                    await standby_stack.enter_async_context(
                        running_operator(replica("standby:1", priority=10))
                    )
                    await eventually(lambda: peers() == 2, what="both replicas in the peering")
                    await user.apply(inferenceservice("first"))
                    await eventually(
                        lambda: server.stored(DEPLOY, "default", "first"), what="the first Deployment"
                    )
                    await settle(server, quiet=0.5)
                    first = image(server, "first")
                finally:
                    await leader.__aexit__(None, None, None)
                await user.apply(inferenceservice("second"))
                await eventually(
                    lambda: server.stored(DEPLOY, "default", "second"), timeout=20, what="a takeover"
                )
    creates = [
        r.url.path
        for r in server.requests
        if r.method.value == "POST" and r.url.path.endswith("/deployments")
    ]
    # the standby paused while the leader lived, then took over (and re-rendered "first" with its image)
    assert (first, image(server, "second"), len(creates)) == ("leader:1", "standby:1", 2)


def image(server: ApiServer, name: str) -> str:
    dep = server.stored(DEPLOY, "default", name) or {}
    return str(dep["spec"]["template"]["spec"]["containers"][0]["image"])
