"""The contracts between the parts (docs/architecture.md §5-§7), as torch-free types and constants.

The engine serves :class:`EngineLoad` at ``GET /load``; the router reads it to pick
engines and to autoscale; the operator and the router agree on the resource group and
the pod labels named here. Nothing in this module imports a part.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Kubernetes resources (docs/architecture.md §7)
API_GROUP = "kvfleet.dev"
API_VERSION = "v1alpha1"
INFERENCESERVICE_PLURAL = "inferenceservices"
TENANTQUOTA_PLURAL = "tenantquotas"

# Engine pods carry these labels; the router finds them by these labels.
LABEL_APP = "app.kubernetes.io/name"
LABEL_APP_ENGINE = "kvfleet-engine"
LABEL_INFERENCESERVICE = "kvfleet.dev/inferenceservice"
# Which engine a pod runs (``spec.engine.kind`` of its InferenceService): the router reads the
# load of each kind its own way (docs/architecture.md §6, "Engine kinds"). A pod without the
# label takes its InferenceService's kind, else ``kvfleet``.
LABEL_ENGINE_KIND = "kvfleet.dev/engine-kind"
ENGINE_KINDS = ("kvfleet", "vllm")
DEFAULT_ENGINE_KIND = "kvfleet"

# The router names the engine that served a request in this response header (and the
# Envoy ext_proc server sets it on the request to pick the ORIGINAL_DST upstream).
HEADER_ENGINE = "x-kvfleet-engine"

DEFAULT_BLOCK_SIZE = 16
DEFAULT_ENGINE_PORT = 8000
DEFAULT_ROUTER_PORT = 8080


class LoraLoad(BaseModel):
    """The LoRA part of ``GET /load``: which adapters are resident and which are asked for."""

    max_loras: int = Field(ge=1, description="adapters the engine holds on its device at once")
    resident: list[str] = Field(default_factory=list, description="adapters loaded on the device now")
    running: list[str] = Field(default_factory=list, description="adapters of running requests")
    waiting: list[str] = Field(default_factory=list, description="adapters of waiting requests")


class EngineLoad(BaseModel):
    """``GET /load`` on an engine: what the router needs to pick and to autoscale."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="the model name the engine serves")
    kv_cache_usage: float = Field(ge=0.0, le=1.0, description="used KV blocks / all KV blocks")
    num_waiting: int = Field(ge=0)
    num_running: int = Field(ge=0)
    max_num_seqs: int = Field(ge=1)
    draining: bool = False
    ready: bool = Field(
        default=True, description="false while loading, draining or once the engine core died"
    )
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1)
    num_kv_blocks: int = Field(default=0, ge=0)
    prefix_cache_hit_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    lora: LoraLoad | None = Field(default=None, description="None when the engine serves no adapters")
