"""The operator's one validated configuration object, built from ``kvfleet operator`` flags."""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_ENGINE_IMAGE = "ghcr.io/kvfleet/kvfleet:0.1.0"
DEFAULT_PEERING_NAME = "kvfleet-operator"


def random_priority() -> int:
    """A peering priority for a replica not given one: distinct replicas rarely collide, and
    kopf pauses every operator that sees a live peer of its own priority."""
    return random.randint(1, 2**31 - 1)


class OperatorConfig(BaseModel):
    """Which namespaces to watch, how replicas agree on who acts, and the engine defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    engine_image: str = Field(default=DEFAULT_ENGINE_IMAGE, min_length=1)
    standalone: bool = False
    peering_name: str = Field(default=DEFAULT_PEERING_NAME, min_length=1)
    priority: int = Field(default_factory=random_priority, ge=0)
    tenantquota_recheck_seconds: float = Field(default=60.0, gt=0)
    liveness_endpoint: str | None = None

    @model_validator(mode="after")
    def _one_scope(self) -> OperatorConfig:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError("give exactly one of --namespace NS (repeatable) or --all-namespaces")
        return self
