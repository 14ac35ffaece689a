"""The CRDs: valid Kubernetes, their schemas and CEL rules refuse what they should, and the
operator's own parsing agrees with them (defaults and refusals)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvfleet.operator.spec import SpecError, parse_inferenceservice, parse_tenantquota
from kvfleet.operator.testing.crd_cases import (
    ADMITTED_ADAPTER_URIS,
    ADMITTED_MODEL_URIS,
    REFUSED_ISVC_CEL,
    REFUSED_ISVC_SCHEMA,
    REFUSED_MODEL_URIS,
    REFUSED_TQ,
    isvc,
    tq,
)
from kvfleet.operator.testing.crdschema import CRD_DIR, ROOT, admit, apply_defaults, load_crds, schema_of

CRDS = load_crds()
K8S = "1.35"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", sorted(CRD_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_crd_file_is_valid_kubernetes(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S, strict=True)


def test_the_inferenceservice_crd_has_scale_status_columns_and_short_names() -> None:
    crd = CRDS["inferenceservices"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Replicas",
        "Ready",
        "Status",
        "Fits",
        "Age",
    ]
    assert crd["spec"]["names"]["shortNames"] == ["kis"]
    assert CRDS["tenantquotas"]["spec"]["names"]["shortNames"] == ["tq"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_manifest_is_admitted(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        if doc["apiVersion"].startswith("kvfleet.dev/"):
            _, errors = admit(CRDS[doc["kind"].lower() + "s"], doc)
            assert errors == []
        else:
            kubernetes_validate.validate(doc, K8S, strict=True)
    assert docs


REFUSED_ISVC = [(case.obj, case.message) for case in REFUSED_ISVC_CEL]


@pytest.mark.parametrize(("obj", "message"), REFUSED_ISVC, ids=[m for _, m in REFUSED_ISVC])
def test_the_cel_rules_refuse_impossible_inferenceservices(obj: dict[str, Any], message: str) -> None:
    _, errors = admit(CRDS["inferenceservices"], obj)
    assert len(errors) == 1 and errors[0].endswith(message)


@pytest.mark.parametrize("uri", ADMITTED_MODEL_URIS)
def test_the_model_uri_rule_admits_folders_and_gguf_files(uri: str) -> None:
    assert admit(CRDS["inferenceservices"], isvc(model={"name": "m", "uri": uri}))[1] == []


@pytest.mark.parametrize("uri", ADMITTED_ADAPTER_URIS)
def test_the_adapter_uri_rule_admits_claims_repos_subfolders_and_paths(uri: str) -> None:
    assert admit(CRDS["inferenceservices"], isvc(adapters=[{"name": "a", "uri": uri}]))[1] == []


@pytest.mark.parametrize("uri", REFUSED_MODEL_URIS)
def test_the_model_uri_rule_refuses_an_hf_file_that_is_not_gguf(uri: str) -> None:
    assert admit(CRDS["inferenceservices"], isvc(model={"name": "m", "uri": uri}))[1] != []


@pytest.mark.parametrize("obj", [o for o, _ in REFUSED_ISVC], ids=[m for _, m in REFUSED_ISVC])
def test_the_operator_refuses_the_same_inferenceservices_naming_the_field(obj: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as err:
        parse_inferenceservice(obj["spec"])
    assert err.value.field.startswith("spec.")


@pytest.mark.parametrize(("obj", "message"), [(c.obj, c.message) for c in REFUSED_ISVC_SCHEMA])
def test_the_schema_refuses_out_of_range_and_unknown_fields(obj: dict[str, Any], message: str) -> None:
    _, errors = admit(CRDS["inferenceservices"], obj)
    assert errors == [message] or errors[0].endswith(message)


@pytest.mark.parametrize(("obj", "message"), [(c.obj, c.message) for c in REFUSED_TQ])
def test_tenantquotas_with_bad_limits_are_refused(obj: dict[str, Any], message: str) -> None:
    _, errors = admit(CRDS["tenantquotas"], obj)
    assert errors and errors[0].endswith(message.replace("<root>", ".spec"))
    with pytest.raises(SpecError):
        parse_tenantquota(obj["spec"])


def test_the_crd_defaults_are_the_operators_defaults() -> None:
    minimal = isvc(autoscaling={"maxReplicas": 3}, slo={}, routing={})
    defaulted = apply_defaults(schema_of(CRDS["inferenceservices"]), copy.deepcopy(minimal))
    assert defaulted["spec"]["engine"]["blockSize"] == 16
    assert parse_inferenceservice(defaulted["spec"]) == parse_inferenceservice(minimal["spec"])
    quota = tq(limits={})
    defaulted_tq = apply_defaults(schema_of(CRDS["tenantquotas"]), copy.deepcopy(quota))
    assert defaulted_tq["spec"]["apiKeySecretRef"] == {"name": "s", "key": "api-key"}
    assert parse_tenantquota(defaulted_tq["spec"]) == parse_tenantquota(quota["spec"])
