"""spec.engine.kind vllm: the engine container runs vLLM's OpenAI server, hardened and guarded as kvfleet's engine is."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.operator import renderers
from kvfleet.operator.spec import SpecError, parse_inferenceservice
from kvfleet.protocol import LABEL_ENGINE_KIND

OWNER = renderers.Owner(name="smol", namespace="prod", uid="0f6e5d0c-0000-4000-8000-000000000002")
MODEL = {"name": "smollm2", "uri": "file:///models/smol", "maxModelLen": 2048}


def spec(engine: dict[str, Any] | None = None, **fields: Any) -> Any:
    return parse_inferenceservice({"model": MODEL, "engine": {"kind": "vllm", **(engine or {})}, **fields})


def deployment(**fields: Any) -> dict[str, Any]:
    return renderers.render_deployment(OWNER, spec(**fields), "vllm/vllm-openai:v0.32.0")


def test_a_vllm_engine_runs_vllm_serve_with_vllms_flag_names() -> None:
    engine = deployment(resources={"gpus": 2})["spec"]["template"]["spec"]["containers"][0]
    assert engine["command"] == ["vllm", "serve"]
    assert engine["args"] == [
        "/models/smol", "--port", "8000", "--served-model-name", "smollm2",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--block-size", "16",
        "--gpu-memory-utilization", "0.9", "--host", "0.0.0.0", "--enable-prefix-caching", "--max-model-len", "2048",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    assert engine["image"] == "vllm/vllm-openai:v0.32.0"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "HF_HOME", "value": "/var/cache/kvfleet/hf"} in engine["env"]


def test_lora_adapters_and_no_prefix_caching_take_vllms_flags() -> None:
    adapters = [{"name": "sql", "uri": "file:///adapters/sql"}]
    engine = deployment(engine={"prefixCaching": False, "maxLoras": 2}, adapters=adapters)
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--no-enable-prefix-caching" in args
    at = args.index("--enable-lora")
    assert args[at:] == ["--enable-lora", "--lora-modules", "sql=/adapters/sql", "--max-loras", "2",
                         "--max-lora-rank", "16"]  # fmt: skip


def test_vllm_pods_carry_the_engine_kind_label_but_the_selector_stays_the_same() -> None:
    rendered = deployment()
    assert rendered["spec"]["template"]["metadata"]["labels"][LABEL_ENGINE_KIND] == "vllm"
    assert rendered["spec"]["selector"]["matchLabels"] == renderers.selector_labels("smol")
    kvfleet = renderers.render_deployment(OWNER, parse_inferenceservice({"model": MODEL}), "kvfleet:1")
    assert kvfleet["spec"]["template"]["metadata"]["labels"][LABEL_ENGINE_KIND] == "kvfleet"
    assert kvfleet["spec"]["template"]["spec"]["containers"][0]["command"] == ["kvfleet", "engine"]


@pytest.mark.parametrize(
    ("engine", "field"),
    [({"attention": "triton"}, "spec.engine.attention"), ({"simulate": True}, "spec.engine.simulate")],
)
def test_fields_kind_vllm_does_not_take_are_refused_naming_the_field(
    engine: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as info:
        spec(engine)
    assert info.value.field == field and "vllm" in info.value.message


def test_an_unknown_engine_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError) as info:
        parse_inferenceservice({"model": MODEL, "engine": {"kind": "sglang"}})
    assert info.value.field == "spec.engine.kind"
