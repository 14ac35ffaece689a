"""The CRDs judged by the real kube-apiserver: they install server-side and become Established (a
structural schema, every CEL rule compiled within its cost budget), every example is admitted, and
every bad manifest of the emulator's cases is refused with the field path named; the emulator's
verdict (:func:`kvfleet.operator.testing.crdschema.admit`) agrees on each case."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.cluster import local
from kvfleet.operator.testing import crd_cases as cases
from kvfleet.operator.testing.crd_cases import Refused, isvc
from kvfleet.operator.testing.crdschema import admit, load_crds

from .conftest import get

CRDS = load_crds()
EXAMPLES = sorted((local.REPO / "examples").glob("*.yaml"))


def server_verdict(cluster: local.Cluster, obj: dict[str, Any]) -> tuple[bool, str]:
    """(admitted, kubectl's message) for ``obj`` applied with ``--dry-run=server``: judged, not stored."""
    done = subprocess.run(
        [str(cluster.bins.kubectl), "apply", "--dry-run=server", "-n", "default", "-f", "-"],
        input=json.dumps(obj), capture_output=True, text=True, env=cluster.env(), timeout=60, check=False,
    )  # fmt: skip
    return done.returncode == 0, done.stdout + done.stderr


def emulator_admits(obj: dict[str, Any]) -> bool:
    return admit(CRDS[obj["kind"].lower() + "s"], obj)[1] == []


def test_the_crds_install_server_side_and_are_established(installed: local.Cluster) -> None:
    for crd in ("inferenceservices.kvfleet.dev", "tenantquotas.kvfleet.dev", "kopfpeerings.kopf.dev"):
        conditions = {c["type"]: c["status"] for c in get(installed, "crd", crd)["status"]["conditions"]}
        assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True", crd
    again = installed.kubectl("apply", "--server-side", "-f", str(local.REPO / "crds"))
    documents = sum(
        len([d for d in yaml.safe_load_all(p.read_text()) if d]) for p in (local.REPO / "crds").glob("*.yaml")
    )
    assert again.count("serverside-applied") == documents == 4, again


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_admitted_by_the_real_server(installed: local.Cluster, path: Path) -> None:
    for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
        doc = {**doc, "metadata": {**doc["metadata"], "namespace": "default"}}
        admitted, message = server_verdict(installed, doc)
        assert admitted, message


CASES = [*cases.REFUSED_ISVC_CEL, *cases.REFUSED_ISVC_SCHEMA, *cases.REFUSED_TQ]


@pytest.mark.parametrize("case", CASES, ids=[c.field + ": " + c.message[-40:] for c in CASES])
def test_each_bad_manifest_is_refused_by_the_real_server_naming_the_field(
    installed: local.Cluster, case: Refused
) -> None:
    admitted, message = server_verdict(installed, case.obj)
    assert not admitted, f"the API server admitted what the emulator refuses ({case.message})"
    assert "is invalid" in message or "unknown field" in message, message
    assert case.field in message, message
    if case in cases.REFUSED_ISVC_CEL or "must be" in case.message and not case.message.startswith("."):
        assert case.message in message, message  # our CEL rule's own words, from the real server
    assert not emulator_admits(case.obj)


@pytest.mark.parametrize("uri", cases.ADMITTED_MODEL_URIS + cases.REFUSED_MODEL_URIS)
def test_the_model_uri_rule_gives_the_same_verdict_on_both_servers(
    installed: local.Cluster, uri: str
) -> None:
    obj = isvc(model={"name": "m", "uri": uri})
    assert server_verdict(installed, obj)[0] == emulator_admits(obj) == (uri in cases.ADMITTED_MODEL_URIS)


@pytest.mark.parametrize("uri", cases.ADMITTED_ADAPTER_URIS)
def test_the_adapter_uri_rule_gives_the_same_verdict_on_both_servers(
    installed: local.Cluster, uri: str
) -> None:
    obj = isvc(adapters=[{"name": "a", "uri": uri}])
    assert server_verdict(installed, obj)[0] == emulator_admits(obj) is True


def test_a_refused_apply_loses_nothing_already_stored(installed: local.Cluster) -> None:
    good = {**isvc(), "metadata": {"name": "keep", "namespace": "default"}}
    good["spec"]["engine"] = {"gpuMemoryUtilization": 0.8, "simulate": True}
    installed.kubectl("apply", "-f", "-", stdin=json.dumps(good))
    try:
        bad = json.loads(json.dumps(good))
        bad["spec"]["engine"]["gpuMemoryUtilization"] = 2.0
        refused = subprocess.run(
            [str(installed.bins.kubectl), "apply", "-f", "-"], input=json.dumps(bad),
            capture_output=True, text=True, env=installed.env(), timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode != 0 and "gpuMemoryUtilization must be in (0, 1]" in refused.stderr
        stored = get(installed, "inferenceservice", "keep", "-n", "default")
        assert stored["spec"]["engine"]["gpuMemoryUtilization"] == 0.8
    finally:
        installed.kubectl("delete", "inferenceservice", "keep", "-n", "default", "--wait=false")
