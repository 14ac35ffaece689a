"""spec.resources.gpus is the tensor-parallel size: what the pure renderers make of it (issue #29)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvfleet.operator import renderers
from kvfleet.operator.spec import parse_inferenceservice

OWNER = renderers.Owner(name="llama70", namespace="prod", uid="0f6e5d0c-0000-4000-8000-000000000029")


def deployment(gpus: int, shm_per_gpu: str | None = None, **resources: Any) -> dict[str, Any]:
    body = {
        "model": {"name": "llama-3-70b", "uri": "file:///models/llama"},
        "resources": {"gpus": gpus, **resources},
    }
    extra = {} if shm_per_gpu is None else {"shm_per_gpu": shm_per_gpu}
    return renderers.render_deployment(OWNER, parse_inferenceservice(body), "img:1", **extra)


def engine(dep: dict[str, Any]) -> dict[str, Any]:
    return dict(dep["spec"]["template"]["spec"]["containers"][0])


def shm(dep: dict[str, Any]) -> dict[str, Any]:
    """The emptyDir mounted at /dev/shm in the engine container."""
    pod = dep["spec"]["template"]["spec"]
    name = next(m["name"] for m in engine(dep)["volumeMounts"] if m["mountPath"] == "/dev/shm")
    return dict(next(v for v in pod["volumes"] if v["name"] == name)["emptyDir"])


def tp_flag(args: list[str]) -> list[str]:
    return [a for i, a in enumerate(args) if "--tensor-parallel-size" in args[max(0, i - 1) : i + 1]]


def test_four_gpus_ask_for_four_gpus_pass_tensor_parallel_size_4_and_give_shm_8_gib() -> None:
    dep = deployment(4)
    assert engine(dep)["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert tp_flag(engine(dep)["args"]) == ["--tensor-parallel-size", "4"]
    assert shm(dep) == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_one_gpu_renders_no_flag_and_the_unlimited_shm_it_always_had() -> None:
    dep = deployment(1)
    assert engine(dep)["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert tp_flag(engine(dep)["args"]) == []
    assert shm(dep) == {"medium": "Memory"}
    assert shm(deployment(0)) == {"medium": "Memory"} and tp_flag(engine(deployment(0))["args"]) == []


@pytest.mark.parametrize(
    ("gpus", "per_gpu", "limit"), [(2, "2Gi", "4Gi"), (8, "2Gi", "16Gi"), (2, "512Mi", "1024Mi")]
)
def test_the_shm_size_limit_is_gpus_times_the_per_gpu_quantity(gpus: int, per_gpu: str, limit: str) -> None:
    assert renderers.shm_size_limit(gpus, per_gpu) == limit
    assert shm(deployment(gpus, per_gpu)) == {"medium": "Memory", "sizeLimit": limit}


def test_the_flag_follows_the_other_engine_flags_and_another_gpu_resource_name_gets_the_count() -> None:
    args = engine(deployment(2, gpuResourceName="amd.com/gpu"))["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args.index("--tensor-parallel-size") > args.index("--drain-timeout")
    assert engine(deployment(2, gpuResourceName="amd.com/gpu"))["resources"]["limits"] == {"amd.com/gpu": "2"}


def test_a_tensor_parallel_deployment_is_valid_kubernetes() -> None:
    kubernetes_validate.validate(deployment(8), "1.35", strict=True)


def test_the_engine_command_line_accepts_the_rendered_tensor_parallel_size() -> None:
    from kvfleet.cli import build_parser

    args = build_parser(only="engine").parse_args(["engine", *engine(deployment(4))["args"]])
    assert args.tensor_parallel_size == 4
