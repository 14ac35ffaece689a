"""``kvfleet operator`` as a user runs it: the CLI in a process of its own, against kmock's emulator.

Without the chart there is no peering object: the operator creates it, or acts alone after a
WARNING naming it and ``--standalone``; it never sits idle in silence. At DEBUG, its whole log
never shows a tenant's API key, though it reads the key's Secret.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kvfleet.operator.testing.apiserver import ApiServer, serve, write_kubeconfig
from kvfleet.operator.testing.cluster import User, inferenceservice, tenantquota
from kvfleet.operator.testing.harness import eventually, kubeconfig_for
from kvfleet.testing.processes import kvfleet_argv, stop

DEPLOY = "apps/v1/deployments"
PEERING = "kopf.dev/v1/clusterkopfpeerings"
KEY = "sk-acme-7f3a9c1e5b2d4086"


@contextlib.contextmanager
def operator_cli(server: ApiServer, folder: Path, *flags: str) -> Iterator[Path]:
    """``kvfleet operator FLAGS`` against the emulator; yields its log file (stdout and stderr), stopped on exit."""
    env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(folder / "operator.kubeconfig", server))}
    log = folder / "operator.log"
    with log.open("wb") as out:
        argv = kvfleet_argv("operator", "--engine-image", "engine:1", *flags)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield log
        finally:
            stop([proc])


async def reconciles(server: ApiServer, client: object, name: str) -> None:
    await User(client).apply(inferenceservice(name))  # type: ignore[arg-type]
    await eventually(lambda: server.stored(DEPLOY, "default", name), timeout=60, what=f"{name}'s Deployment")


async def test_without_the_charts_peering_the_operator_creates_it_and_reconciles(tmp_path: Path) -> None:
    async with serve() as server:
        with kubeconfig_for(server, tmp_path) as client, operator_cli(server, tmp_path, "-A") as log:
            await reconciles(server, client, "first")
            assert server.stored(PEERING, None, "kvfleet-operator") is not None
    assert (
        "INFO kvfleet.operator.peering created the ClusterKopfPeering 'kvfleet-operator'" in log.read_text()
    )


async def test_a_peering_it_may_not_create_makes_the_operator_act_alone_with_a_warning(
    tmp_path: Path,
) -> None:
    async with serve() as server:
        server.fail_next("create", "clusterkopfpeerings", 403)
        with kubeconfig_for(server, tmp_path) as client, operator_cli(server, tmp_path, "-A") as log:
            await reconciles(server, client, "alone")
            assert server.stored(PEERING, None, "kvfleet-operator") is None
    warnings = [line for line in log.read_text().splitlines() if " WARNING " in line]
    assert any(
        "ClusterKopfPeering 'kvfleet-operator' does not exist" in w and "--standalone" in w for w in warnings
    )


async def test_the_operator_at_debug_reads_a_tenants_key_secret_and_never_logs_the_key(
    tmp_path: Path,
) -> None:
    async with serve() as server:
        with (
            kubeconfig_for(server, tmp_path) as client,
            operator_cli(server, tmp_path, "-n", "default", "-v") as log,
        ):
            user = User(client)
            await user.create_secret("acme-key", "api-key", KEY)
            await user.apply(tenantquota("acme"))
            await reconciles(server, client, "llama")

            def valid() -> bool:
                status = (server.stored("kvfleet.dev/v1alpha1/tenantquotas", "default", "acme") or {}).get(
                    "status"
                )
                return any(
                    c["type"] == "Valid" and c["status"] == "True"
                    for c in (status or {}).get("conditions", [])
                )

            await eventually(valid, timeout=60, what="the TenantQuota Valid")
    reads = [
        r for r in server.requests if r.method.value == "GET" and r.url.path.endswith("/secrets/acme-key")
    ]
    text = log.read_text()
    assert reads and " DEBUG " in text, "the operator read the Secret, and logged at DEBUG"
    assert KEY not in text and base64.b64encode(KEY.encode()).decode() not in text
