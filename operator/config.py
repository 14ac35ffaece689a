"""The operator's one validated configuration object, built from ``kvfleet operator`` flags."""

from __future__ import annotations

import os
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvfleet import __version__

from .network_policy import IngressSources
from .renderers import DEFAULT_SHM_PER_GPU

DEFAULT_PEERING_NAME = "kvfleet-operator"
# The engine images when neither spec.engine.image nor a flag names one: the environment (the chart
# sets it), else the bare names `make images` builds, tagged with this package's version. No registry
# is written here: the chart (image.registry) says where the images live.
ENGINE_IMAGE_ENV = {"cpu": "KVFLEET_ENGINE_IMAGE_CPU", "cuda": "KVFLEET_ENGINE_IMAGE_CUDA"}


def default_engine_image(variant: str) -> str:
    return os.environ.get(ENGINE_IMAGE_ENV[variant]) or f"kvfleet-engine-{variant}:{__version__}"


def random_priority() -> int:
    """A peering priority for a replica not given one: distinct replicas rarely collide, and
    kopf pauses every operator that sees a live peer of its own priority."""
    return random.randint(1, 2**31 - 1)


class OperatorConfig(BaseModel):
    """Which namespaces to watch, how replicas agree on who acts, and the engine defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    # One image for every InferenceService (--engine-image), else -cuda for those with GPUs, -cpu for the rest.
    engine_image: str | None = Field(default=None, min_length=1)
    engine_image_cpu: str = Field(default_factory=lambda: default_engine_image("cpu"), min_length=1)
    engine_image_cuda: str = Field(default_factory=lambda: default_engine_image("cuda"), min_length=1)
    # The image of spec.engine.kind vllm engines that name none (--vllm-image; the chart's operator.vllmImage).
    vllm_image: str = Field(default="vllm/vllm-openai:v0.32.0", min_length=1)
    # /dev/shm per GPU of a tensor-parallel engine pod (renderers.shm_size_limit): a Mi or Gi quantity.
    engine_shm_per_gpu: str = Field(default=DEFAULT_SHM_PER_GPU, pattern=r"^[1-9][0-9]*(Mi|Gi)$")
    standalone: bool = False
    peering_name: str = Field(default=DEFAULT_PEERING_NAME, min_length=1)
    priority: int = Field(default_factory=random_priority, ge=0)
    tenantquota_recheck_seconds: float = Field(default=60.0, gt=0)
    liveness_endpoint: str | None = None
    # Each InferenceService's NetworkPolicy: engines accept the router's and the gateway's pods (in
    # router_namespace; None: any namespace) and the metrics_from NetworkPolicyPeers (Prometheus).
    network_policy: bool = True
    router_namespace: str | None = Field(default=None, min_length=1)
    metrics_from: tuple[dict[str, Any], ...] = ()
    # OpenTelemetry (docs/architecture.md §8): an OTLP endpoint puts the standard OTEL_* variables on
    # every engine pod (engine_env), as the chart puts them on the router's.
    otel_endpoint: str | None = Field(default=None, min_length=1)
    otel_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"

    def ingress_sources(self) -> IngressSources | None:
        """Who may reach the engine pods; None: render no NetworkPolicy."""
        return IngressSources(self.router_namespace, self.metrics_from) if self.network_policy else None

    @field_validator("metrics_from")
    @classmethod
    def _peers(cls, peers: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        for peer in peers:
            unknown = set(peer) - {"namespaceSelector", "podSelector", "ipBlock"}
            if not peer or unknown:
                raise ValueError(
                    f"--metrics-from: a NetworkPolicyPeer has namespaceSelector, podSelector or ipBlock, "
                    f"got {sorted(peer) if peer else 'an empty object'}"
                )
        return peers

    def engine_env(self) -> dict[str, str]:
        """The environment every engine container gets from the operator (none while tracing is off)."""
        if self.otel_endpoint is None:
            return {}
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.otel_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": self.otel_protocol,
            "OTEL_SERVICE_NAME": "kvfleet-engine",
        }

    def engine_image_for(self, gpus: int, kind: str = "kvfleet") -> str:
        """The engine image of an InferenceService that does not name its own."""
        if kind == "vllm":
            return self.vllm_image
        if self.engine_image is not None:
            return self.engine_image
        return self.engine_image_cuda if gpus > 0 else self.engine_image_cpu

    @model_validator(mode="after")
    def _one_scope(self) -> OperatorConfig:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError("give exactly one of --namespace NS (repeatable) or --all-namespaces")
        return self
