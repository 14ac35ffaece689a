"""The chart's settings that reach engine pods only through the operator: OTel variables (issue #32), the vLLM image (#31).

The chart gives the router its OTEL_* variables itself; engine pods are the operator's to render, so
the chart passes ``--otel-endpoint``/``--otel-protocol`` to the operator, which puts the same
variables (service name ``kvfleet-engine``) on every engine container it renders.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.cli import build_parser
from kvfleet.operator import renderers
from kvfleet.operator.cli import config_from_args
from kvfleet.operator.spec import parse_inferenceservice
from kvfleet.operator.testing.chart import render


def engine_env(values: dict[str, Any]) -> dict[str, str] | None:
    """The engine container's env as the operator, run with the chart's flags, renders it."""
    docs = render(values)
    operator = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("operator")
    )
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    config = config_from_args(build_parser(only="operator").parse_args(["operator", *args]))
    spec = parse_inferenceservice({"model": {"name": "tiny", "uri": "file:///opt/kvfleet/models/tiny"}})
    children = renderers.render_children(renderers.Owner("svc", "ns", "uid"), spec, "img:1")
    deployment = renderers.with_engine_env(
        next(c for c in children if c["kind"] == "Deployment"), config.engine_env()
    )
    (engine,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return None if "env" not in engine else {e["name"]: e["value"] for e in engine["env"]}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_otel_endpoint_of_the_chart_becomes_every_engine_pods_otel_variables(protocol: str) -> None:
    env = engine_env({"otel": {"endpoint": "http://collector:4317", "protocol": protocol}})
    assert env == {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_SERVICE_NAME": "kvfleet-engine",
    }


def test_without_an_endpoint_engine_pods_get_no_otel_variables() -> None:
    assert engine_env({}) is None


def test_an_unknown_protocol_is_refused_naming_the_flag() -> None:
    with pytest.raises(SystemExit):
        build_parser(only="operator").parse_args(["operator", "--otel-protocol", "udp"])


def test_the_charts_vllm_image_is_the_operators_image_for_vllm_engines() -> None:
    docs = render({"operator": {"vllmImage": "registry.local/vllm-openai:v0.32.1"}})
    operator = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("operator")
    )
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    config = config_from_args(build_parser(only="operator").parse_args(["operator", *args]))
    assert config.engine_image_for(1, "vllm") == "registry.local/vllm-openai:v0.32.1"
    assert config.engine_image_for(1, "kvfleet") != config.vllm_image
