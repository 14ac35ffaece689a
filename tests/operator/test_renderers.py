"""The pure renderers: every spec field and what it becomes in the engine Deployment, Service, PDB."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvfleet.operator import renderers
from kvfleet.operator.spec import parse_inferenceservice

OWNER = renderers.Owner(name="llama", namespace="prod", uid="0f6e5d0c-0000-4000-8000-000000000001")
K8S = "1.35"


def spec(**fields: Any) -> Any:
    body: dict[str, Any] = {"model": {"name": "llama-3-8b", "uri": "file:///models/llama"}}
    body.update(fields)
    return parse_inferenceservice(body)


def pod(**fields: Any) -> dict[str, Any]:
    return renderers.render_deployment(OWNER, spec(**fields), "img:1")["spec"]["template"]["spec"]


def container(**fields: Any) -> dict[str, Any]:
    return dict(pod(**fields)["containers"][0])


def model_volumes(p: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in p["volumes"] if v["name"] == "model"]


def model_mounts(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in c["volumeMounts"] if m["name"] == "model"]


def test_default_spec_renders_the_engine_flags_of_the_design_in_order() -> None:
    assert container()["command"] == ["kvfleet", "engine"]
    assert container()["args"] == [
        "--model", "/models/llama",
        "--port", "8000",
        "--served-model-name", "llama-3-8b",
        "--max-num-seqs", "256",
        "--max-num-batched-tokens", "8192",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.9",
        "--drain-timeout", "60",
    ]  # fmt: skip


def test_every_engine_and_model_field_becomes_its_flag() -> None:
    args = container(
        model={"name": "m", "uri": "file:///w", "dtype": "float16", "maxModelLen": 4096},
        engine={
            "blockSize": 32,
            "maxNumSeqs": 8,
            "maxNumBatchedTokens": 512,
            "gpuMemoryUtilization": 0.85,
            "prefixCaching": False,
            "attention": "triton",
            "simulate": True,
        },
        slo={"ttftMs": 2000, "itlP99Ms": 250},
    )["args"]
    assert args == [
        "--model", "/w",
        "--port", "8000",
        "--served-model-name", "m",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512",
        "--block-size", "32",
        "--gpu-memory-utilization", "0.85",
        "--drain-timeout", "60",
        "--no-prefix-caching",
        "--max-model-len", "4096",
        "--dtype", "float16",
        "--attention", "triton",
        "--simulate",
        "--target-step-ms", "250",
    ]  # fmt: skip


def test_gpus_are_limits_of_the_named_resource_and_cpu_memory_are_requests() -> None:
    res = container(resources={"gpus": 2, "gpuResourceName": "amd.com/gpu", "cpu": "8", "memory": "64Gi"})[
        "resources"
    ]
    assert res == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "amd.com/gpu": "2"},
    }
    assert container(resources={"gpus": 1})["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert "resources" not in container(resources={"gpus": 0})


def test_probes_hit_health_and_ready_and_prestop_sleeps_before_the_drain() -> None:
    c = container(engine={"drainSeconds": 90})
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod(engine={"drainSeconds": 90})["terminationGracePeriodSeconds"] == 95


def test_a_pvc_uri_mounts_the_claim_read_only_and_points_the_engine_inside_it() -> None:
    p = pod(model={"name": "m", "uri": "pvc://weights/llama/8b"})
    assert model_volumes(p) == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    ]
    assert model_mounts(p["containers"][0]) == [{"name": "model", "mountPath": "/models", "readOnly": True}]
    assert p["containers"][0]["args"][:2] == ["--model", "/models/llama/8b"]
    assert renderers.model_source("pvc://weights").path == "/models"


def test_an_hf_uri_downloads_into_an_empty_dir_first_with_the_token_secret() -> None:
    model = {
        "name": "m",
        "uri": "hf://meta-llama/Meta-Llama-3-8B@main",
        "credentialsSecretRef": {"name": "hf"},
    }
    p = pod(model=model)
    assert model_volumes(p) == [{"name": "model", "emptyDir": {}}]
    fetch = p["initContainers"][0]
    assert fetch["args"] == ["meta-llama/Meta-Llama-3-8B", "main", "/models/meta-llama/Meta-Llama-3-8B"]
    assert fetch["env"] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    assert p["containers"][0]["args"][:2] == ["--model", "/models/meta-llama/Meta-Llama-3-8B"]


def test_an_hf_gguf_uri_fetches_only_that_file_and_points_the_engine_at_it() -> None:
    p = pod(model={"name": "m", "uri": "hf://org/repo/quant/model.Q4_K.gguf@v2"})
    fetch = p["initContainers"][0]
    assert fetch["args"] == ["org/repo", "v2", "/models/org/repo", "quant/model.Q4_K.gguf"]
    assert p["containers"][0]["args"][:2] == ["--model", "/models/org/repo/quant/model.Q4_K.gguf"]


def test_a_pvc_gguf_uri_points_the_engine_at_the_file_in_the_claim() -> None:
    p = pod(model={"name": "m", "uri": "pvc://weights/smol/SmolLM2-135M-Instruct.Q4_1.gguf"})
    assert p["containers"][0]["args"][:2] == ["--model", "/models/smol/SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert "initContainers" not in p


ADAPTERS = [
    {"name": "sql", "uri": "pvc://loras/sql-v2"},
    {"name": "chat", "uri": "pvc://loras/chat"},
    {"name": "legal", "uri": "hf://acme/legal-lora/rank16@v1"},
    {"name": "baked", "uri": "file:///opt/kvfleet/adapters/baked"},
]


def test_adapters_become_lora_modules_with_a_volume_per_claim_and_a_download_per_hf_repo() -> None:
    model = {"name": "m", "uri": "file:///w", "credentialsSecretRef": {"name": "hf"}}
    p = pod(model=model, adapters=ADAPTERS, engine={"maxLoras": 2, "maxLoraRank": 64})
    args = p["containers"][0]["args"]
    start = args.index("--lora-modules")
    assert args[start:] == [
        "--lora-modules",
        "sql=/adapters/adapters-pvc-0/sql-v2",
        "chat=/adapters/adapters-pvc-0/chat",
        "legal=/adapters/hf/legal/rank16",
        "baked=/opt/kvfleet/adapters/baked",
        "--max-loras", "2",
        "--max-lora-rank", "64",
    ]  # fmt: skip
    assert [v for v in p["volumes"] if v["name"].startswith("adapters")] == [
        {"name": "adapters-pvc-0", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}},
        {"name": "adapters-hf", "emptyDir": {}},
    ]
    assert [m for m in p["containers"][0]["volumeMounts"] if m["name"].startswith("adapters")] == [
        {"name": "adapters-pvc-0", "mountPath": "/adapters/adapters-pvc-0", "readOnly": True},
        {"name": "adapters-hf", "mountPath": "/adapters/hf", "readOnly": True},
    ]
    (fetch,) = p["initContainers"]
    assert fetch["name"] == "fetch-adapter-0"
    assert fetch["args"] == ["acme/legal-lora", "v1", "/adapters/hf/legal", "rank16/*"]
    assert {"name": "adapters-hf", "mountPath": "/adapters/hf"} in fetch["volumeMounts"]
    assert fetch["env"] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]


def test_without_adapters_no_lora_flag_volume_or_download_is_rendered() -> None:
    p = pod(engine={"maxLoras": 8})
    assert not any(a.startswith("--lora") or a.startswith("--max-lora") for a in p["containers"][0]["args"])
    assert "initContainers" not in p
    assert not [v for v in p["volumes"] if v["name"].startswith("adapters")]


def test_an_hf_model_and_an_hf_adapter_download_one_after_the_other() -> None:
    p = pod(model={"name": "m", "uri": "hf://org/base"}, adapters=[{"name": "a", "uri": "hf://org/a"}])
    assert [c["name"] for c in p["initContainers"]] == ["fetch-model", "fetch-adapter-0"]
    assert p["initContainers"][1]["args"] == ["org/a", "", "/adapters/hf/a"]


def test_engine_pods_run_hardened_with_writable_scratch_only_in_empty_dirs() -> None:
    p = pod(model={"name": "m", "uri": "hf://org/name"})
    assert p["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    scratch = {"cache": "/var/cache/kvfleet", "tmp": "/tmp", "dshm": "/dev/shm"}
    assert {v["name"]: v["emptyDir"] for v in p["volumes"] if v["name"] in scratch} == {
        "cache": {},
        "tmp": {},
        "dshm": {"medium": "Memory"},
    }
    for c in (p["containers"][0], p["initContainers"][0]):
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"] if m["name"] in scratch} == scratch


def test_placement_fields_reach_the_pod() -> None:
    placement = {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {}},
        "priorityClassName": "inference",
    }
    p = pod(placement=placement)
    assert p["nodeSelector"] == {"gpu": "h100"}
    assert p["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert (p["affinity"], p["priorityClassName"]) == ({"nodeAffinity": {}}, "inference")
    assert {"nodeSelector", "tolerations", "affinity", "priorityClassName"}.isdisjoint(pod())


def test_replicas_rolling_update_labels_and_owner_reference() -> None:
    dep = renderers.render_deployment(OWNER, spec(replicas=3, engine={"image": "mine:2"}), "img:1")
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    assert dep["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.dev/inferenceservice": "llama"}
    }
    assert dep["spec"]["template"]["metadata"]["labels"]["kvfleet.dev/inferenceservice"] == "llama"
    assert dep["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "kvfleet.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert (
        dep["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    )  # the caller resolves the image


def test_service_and_pdb_select_the_engine_pods() -> None:
    svc = renderers.render_service(OWNER, spec())
    pdb = renderers.render_pdb(OWNER, spec())
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert (
        svc["spec"]["selector"]
        == pdb["spec"]["selector"]["matchLabels"]
        == renderers.selector_labels("llama")
    )
    assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"model": {"name": "m", "uri": "pvc://w/x"}, "resources": {"gpus": 4, "cpu": 16, "memory": "200Gi"}},
        {
            "model": {"name": "m", "uri": "hf://org/name", "credentialsSecretRef": {"name": "hf"}},
            "replicas": 0,
        },
        {
            "placement": {
                "tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute"}]
            }
        },
        {"model": {"name": "m", "uri": "hf://org/name"}, "adapters": ADAPTERS},
    ],
)
def test_every_rendered_object_is_valid_kubernetes(fields: dict[str, Any]) -> None:
    for obj in renderers.render_children(OWNER, spec(**fields), "img:1"):
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_a_spec_without_a_dtype_renders_no_dtype_flag_so_the_engine_s_auto_decides() -> None:
    from kvfleet.cli import build_parser

    args = container(model={"name": "m", "uri": "pvc://w/x"})["args"]
    assert "--dtype" not in args
    assert build_parser(only="engine").parse_args(["engine", *args]).dtype == "auto"


def test_the_engine_command_line_accepts_every_rendered_argument() -> None:
    from kvfleet.cli import build_parser

    fields = {
        "model": {"name": "m", "uri": "pvc://w/x", "dtype": "bfloat16", "maxModelLen": 2048},
        "engine": {"prefixCaching": False, "attention": "triton", "simulate": True, "drainSeconds": 45},
        "adapters": ADAPTERS[:2],
    }
    args = build_parser(only="engine").parse_args(["engine", *container(**fields)["args"]])
    assert (args.model, args.served_model_name, args.port, args.max_model_len, args.dtype) == (
        "/models/x",
        "m",
        8000,
        2048,
        "bfloat16",
    )
    assert (args.no_prefix_caching, args.attention, args.simulate, args.drain_timeout) == (
        True,
        "triton",
        True,
        45.0,
    )
    assert args.lora_modules == ["sql=/adapters/adapters-pvc-0/sql-v2", "chat=/adapters/adapters-pvc-0/chat"]
    assert (args.max_loras, args.max_lora_rank) == (4, 16)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size, args.gpu_memory_utilization) == (
        256,
        8192,
        16,
        0.9,
    )


def test_engine_pods_carry_no_service_account_token() -> None:
    assert pod()["automountServiceAccountToken"] is False
