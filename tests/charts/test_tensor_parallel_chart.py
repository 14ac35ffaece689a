"""The chart and the operator agree on a tensor-parallel engine pod (issue #29), through real Helm.

The chart renders no engine pod itself: it gives the operator its flags, and the operator renders
each InferenceService's pod. So the chart's side is the operator container's arguments as Helm
renders them; the pod those flags make must be the one the pure renderers make by default.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.cli import build_parser
from kvfleet.operator import renderers
from kvfleet.operator.cli import config_from_args
from kvfleet.operator.spec import parse_inferenceservice
from kvfleet.operator.testing.chart import render

OWNER = renderers.Owner("llama70", "default", "uid")


def operator_args(values: dict[str, Any]) -> list[str]:
    deployment = next(d for d in render(values) if d["metadata"]["name"] == "kvf-operator")
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def spec(gpus: int) -> Any:
    body = {"model": {"name": "llama-3-70b", "uri": "file:///m"}, "resources": {"gpus": gpus}}
    return parse_inferenceservice(body)


def pod_from_chart(gpus: int, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine pod of an InferenceService with ``gpus`` GPUs, rendered by the operator the chart configures."""
    args = build_parser(only="operator").parse_args(["operator", *operator_args(values or {})])
    config = config_from_args(args)
    dep = renderers.render_deployment(OWNER, spec(gpus), "img:1", config.engine_shm_per_gpu)
    return dict(dep["spec"]["template"]["spec"])


def shm_and_flag(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    engine = pod["containers"][0]
    name = next(m["name"] for m in engine["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == name)["emptyDir"]
    args = engine["args"]
    flag = args[args.index("--tensor-parallel-size") :][:2] if "--tensor-parallel-size" in args else []
    return volume, flag, engine["resources"]["limits"]


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_the_pod_the_chart_configures_is_the_pod_the_renderers_make_by_default(gpus: int) -> None:
    default = renderers.render_deployment(OWNER, spec(gpus), "img:1")["spec"]["template"]["spec"]
    assert pod_from_chart(gpus) == default


def test_four_gpus_through_the_chart_get_four_gpus_the_flag_and_8_gib_of_shm() -> None:
    assert "--engine-shm-per-gpu=2Gi" in operator_args({})
    assert shm_and_flag(pod_from_chart(4)) == (
        {"medium": "Memory", "sizeLimit": "8Gi"},
        ["--tensor-parallel-size", "4"],
        {"nvidia.com/gpu": "4"},
    )
    assert shm_and_flag(pod_from_chart(1)) == ({"medium": "Memory"}, [], {"nvidia.com/gpu": "1"})


def test_the_charts_shm_per_gpu_value_reaches_the_pod_and_a_bad_one_fails_the_render() -> None:
    values = {"operator": {"engineShmPerGPU": "4Gi"}}
    assert shm_and_flag(pod_from_chart(4, values))[0] == {"medium": "Memory", "sizeLimit": "16Gi"}
    with pytest.raises(Exception, match="operator.engineShmPerGPU must be a Mi or Gi quantity"):
        render({"operator": {"engineShmPerGPU": "2G"}})
