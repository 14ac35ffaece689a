"""A tensor-parallel InferenceService on kopf's real runtime and the emulated API server (issue #29):
gpus 2 reaches the engine pod as two GPUs, --tensor-parallel-size 2 and a sized /dev/shm, and the
status's CapacityFits is the engine's own per-GPU verdict; a gpus too small for the model is
refused and the last good Deployment keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet import capacity
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.testing.apiserver import ApiServer, serve
from kvfleet.operator.testing.cluster import User, inferenceservice
from kvfleet.operator.testing.harness import eventually, kubeconfig_for, running_operator

ISVC = "kvfleet.dev/v1alpha1/inferenceservices"
DEPLOY = "apps/v1/deployments"
CONFIG = OperatorConfig(
    namespaces=("default",), standalone=True, engine_image="kvfleet:test", engine_shm_per_gpu="3Gi"
)
MODEL = {"name": "llama-3-70b", "uri": "file:///models/llama-3-70b", "maxModelLen": 4096}


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[ApiServer, User]]:
    async with serve() as server:
        with kubeconfig_for(server, tmp_path) as client:
            yield server, User(client)


def condition(server: ApiServer, kind: str) -> tuple[str, str, str] | None:
    obj = server.stored(ISVC, "default", "llama") or {}
    for c in (obj.get("status") or {}).get("conditions", []):
        if c["type"] == kind:
            return c["status"], c["reason"], c["message"]
    return None


def engine_pod(server: ApiServer) -> dict[str, Any]:
    return dict((server.stored(DEPLOY, "default", "llama") or {})["spec"]["template"]["spec"])


async def test_two_gpus_reach_the_pod_as_tensor_parallel_and_capacity_fits_per_gpu(env: Any) -> None:
    server, user = env
    async with running_operator(CONFIG):
        await user.apply(inferenceservice(model=MODEL, resources={"gpus": 2, "gpuType": "h100"}))
        await eventually(lambda: server.stored(DEPLOY, "default", "llama"), timeout=20, what="the Deployment")
        await eventually(lambda: condition(server, "CapacityFits"), what="CapacityFits")
    pod = engine_pod(server)
    engine = pod["containers"][0]
    assert engine["args"][engine["args"].index("--tensor-parallel-size") :][:2] == [
        "--tensor-parallel-size",
        "2",
    ]
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "6Gi"}} in pod["volumes"]
    fits = capacity.check_engine_fits(
        capacity.KNOWN_MODELS["llama-3-70b"], "bfloat16", 2, 80 * capacity.GIB, 0.9, 4096, 16
    )
    status = (server.stored(ISVC, "default", "llama") or {})["status"]
    assert condition(server, "CapacityFits")[:2] == ("True", "Fits")  # type: ignore[index]
    assert {k: status["capacity"][k] for k in ("tensorParallelSize", "weightsBytesPerGpu", "kvBlocks")} == {
        "tensorParallelSize": 2,
        "weightsBytesPerGpu": fits.weights_bytes_per_rank,
        "kvBlocks": fits.num_kv_blocks,
    }
    assert (status["capacity"]["kvHeadsPerGpu"], status["capacity"]["kvBytesPerTokenPerGpu"]) == (4, 163_840)


async def test_one_gpu_for_seventy_b_is_refused_and_the_two_gpu_deployment_keeps_serving(env: Any) -> None:
    server, user = env
    async with running_operator(CONFIG):
        await user.apply(inferenceservice(model=MODEL, resources={"gpus": 2, "gpuType": "h100"}))
        await eventually(lambda: server.stored(DEPLOY, "default", "llama"), timeout=20, what="the Deployment")
        await user.apply(inferenceservice(model=MODEL, resources={"gpus": 1, "gpuType": "h100"}))
        await eventually(
            lambda: (condition(server, "CapacityFits") or ("",))[0] == "False", what="CapacityFits False"
        )
        await eventually(lambda: (condition(server, "Degraded") or ("",))[0] == "True", what="Degraded")
    assert condition(server, "CapacityFits")[1] == "InsufficientGPUMemory"  # type: ignore[index]
    assert "(weights 141107412992)" in condition(server, "CapacityFits")[2]  # type: ignore[index]
    assert engine_pod(server)["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
