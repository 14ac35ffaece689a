"""An InferenceService of spec.engine.kind vllm on kopf's real runtime and the emulated API server (issue #31):
the Deployment runs vllm serve from the operator's vLLM image, its pods labelled with their kind."""

from __future__ import annotations

from typing import Any

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.testing.cluster import inferenceservice
from kvfleet.operator.testing.harness import eventually, running_operator
from kvfleet.protocol import LABEL_ENGINE_KIND

DEPLOY = "apps/v1/deployments"
CONFIG = OperatorConfig(namespaces=("default",), standalone=True, vllm_image="vllm/vllm-openai:test")


async def test_a_vllm_inference_service_becomes_a_vllm_serve_deployment_from_the_vllm_image(env: Any) -> None:
    server, user = env
    async with running_operator(CONFIG):
        await user.apply(inferenceservice(engine={"kind": "vllm"}, resources={"gpus": 2}))
        await eventually(lambda: server.stored(DEPLOY, "default", "llama"), timeout=20, what="the Deployment")
    template = (server.stored(DEPLOY, "default", "llama") or {})["spec"]["template"]
    engine = template["spec"]["containers"][0]
    assert (engine["image"], engine["command"]) == ("vllm/vllm-openai:test", ["vllm", "serve"])
    assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "2"
    assert template["metadata"]["labels"][LABEL_ENGINE_KIND] == "vllm"
