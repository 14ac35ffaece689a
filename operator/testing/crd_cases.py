"""The admission cases of the CRDs, one list for both judges (docs/cluster.md, "Which verdicts come from where").

The emulator's :func:`.crdschema.admit` judges them in the fast unit tests (tests/operator/test_crds.py);
the real kube-apiserver judges the same objects in e2e/cluster/test_crds_on_the_apiserver.py, which
also checks that the two verdicts agree. Each refused case names the field path the refusal is about.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .cluster import manifest


class Refused(NamedTuple):
    obj: dict[str, Any]
    message: str  # the emulator's message (a CEL rule's own text where the rule is ours)
    field: str  # the field path both servers name


def isvc(**spec: Any) -> dict[str, Any]:
    return manifest("InferenceService", "m", {"model": {"name": "m", "uri": "file:///w"}} | spec)


def tq(**spec: Any) -> dict[str, Any]:
    return manifest("TenantQuota", "t", {"tenant": "t", "apiKeySecretRef": {"name": "s"}} | spec)


REFUSED_ISVC_CEL = [
    Refused(
        isvc(model={"name": "m", "uri": "s3://bucket/w"}),
        "uri must be pvc://CLAIM[/PATH], hf://ORG/NAME[/FILE.gguf][@REVISION] or file:///ABSOLUTE/PATH",
        "spec.model",
    ),
    Refused(
        isvc(autoscaling={"minReplicas": 5, "maxReplicas": 2}),
        "minReplicas must be <= maxReplicas",
        "spec.autoscaling",
    ),
    Refused(
        isvc(autoscaling={"minReplicas": 0, "maxReplicas": 2}),
        "minReplicas 0 needs scaleToZero: true",
        "spec.autoscaling",
    ),
    Refused(
        isvc(engine={"gpuMemoryUtilization": 1.5}), "gpuMemoryUtilization must be in (0, 1]", "spec.engine"
    ),
    Refused(
        isvc(engine={"maxNumSeqs": 512, "maxNumBatchedTokens": 256}),
        "maxNumBatchedTokens must be at least maxNumSeqs (every running sequence needs a token each step)",
        "spec.engine",
    ),
    Refused(isvc(resources={"gpus": 0, "gpuType": "h100"}), "gpuType needs gpus > 0", "spec.resources"),
    Refused(
        isvc(adapters=[{"name": "a", "uri": "s3://bucket/a"}]),
        "adapter uri must be pvc://CLAIM[/PATH], hf://ORG/NAME[/SUBFOLDER][@REVISION] or file:///ABSOLUTE/PATH",
        "spec.adapters[0]",
    ),
    Refused(
        isvc(adapters=[{"name": "a", "uri": "file:///a"}, {"name": "a", "uri": "file:///b"}]),
        "adapter names must be unique",
        "spec.adapters",
    ),
    Refused(
        isvc(adapters=[{"name": "m", "uri": "file:///a"}]),
        "an adapter may not take the model's name (clients tell them apart by it)",
        "spec",
    ),
    Refused(
        isvc(engine={"kind": "vllm", "quantization": "int8"}),
        "quantization: int8 is kvfleet's CPU format; kind vllm takes fp8 or gguf",
        "spec.engine",
    ),
]

REFUSED_ISVC_SCHEMA = [
    Refused(
        isvc(engine={"blockSize": 12}),
        ".spec.engine.blockSize: 12 is not one of [8, 16, 32, 64, 128]",
        "spec.engine.blockSize",
    ),
    Refused(isvc(replicas=-1), ".spec.replicas: -1 is less than the minimum of 0", "spec.replicas"),
    Refused(
        isvc(engine={"maxLoras": 0}),
        ".spec.engine.maxLoras: 0 is less than the minimum of 1",
        "spec.engine.maxLoras",
    ),
    Refused(
        isvc(adapters=[{"name": "a b", "uri": "file:///a"}]),
        "does not match '^[A-Za-z0-9][-A-Za-z0-9_.]*$'",
        "spec.adapters[0].name",
    ),
    Refused(isvc(modle={"name": "x"}), "unknown field '.spec.modle'", "spec.modle"),
    Refused(
        {**isvc(), "metadata": {"name": "Llama_3"}},
        "metadata.name must be a DNS-1035 label of at most 63 characters (it names the Service)",
        "metadata.name",
    ),
]

REFUSED_TQ = [
    Refused(
        tq(limits={"tokensPerMinute": 1000, "maxTokensPerRequest": 4000}),
        "maxTokensPerRequest must be <= tokensPerMinute (such a request could never be admitted)",
        "spec.limits",
    ),
    Refused(
        tq(limits={"requestsPerMinute": 0}),
        ".spec.limits.requestsPerMinute: 0 is less than the minimum of 1",
        "spec.limits.requestsPerMinute",
    ),
    Refused(tq(weight=0), ".spec.weight: 0 is less than the minimum of 1", "spec.weight"),
    Refused(
        {**tq(), "spec": {"tenant": "t"}},
        "<root>: 'apiKeySecretRef' is a required property",
        "spec.apiKeySecretRef",
    ),
]

ADMITTED_MODEL_URIS = [
    "hf://org/repo/model.Q4_1.gguf",
    "hf://org/repo/q/model.gguf@main",
    "pvc://claim/dir/model.gguf",
    "hf://org/repo",
]
ADMITTED_ADAPTER_URIS = ["pvc://loras/sql", "hf://org/repo", "hf://org/repo/sub/dir@main", "file:///a"]
REFUSED_MODEL_URIS = ["hf://org/repo/model.bin", "hf://org/repo/dir/"]
