"""The router's one validated configuration (docs/architecture.md §3, §6), built once per process.

``kvfleet router`` turns its flags and the ``--tenants`` YAML file into a
:class:`RouterConfig`; :func:`kvfleet.router.app.build_app` takes nothing else. The
tenant entries share the shape of the ``TenantQuota`` spec (docs/architecture.md §7), so a
tenants file and the Kubernetes resources are read by the same models (:mod:`kvfleet.resources`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvfleet.http_guard import DEFAULT_MAX_BODY_BYTES
from kvfleet.protocol import DEFAULT_ENGINE_KIND, ENGINE_KINDS
from kvfleet.resources import SLOSpec, TenantLimits, TenantSpec
from kvfleet.router.gateway_config import GatewayConfig


class ConfigError(ValueError):
    """A configuration value the router refuses, with the field and the reason."""


class FileTenantLimits(TenantLimits):
    """``limits`` of a tenants-file entry: a misspelt limit is refused, not ignored as the cluster prunes it."""

    model_config = ConfigDict(extra="forbid")


class TenantEntry(TenantSpec):
    """One entry of a tenants file: a TenantQuota spec with the key inline."""

    api_key: str = Field(alias="apiKey", min_length=8)
    limits: FileTenantLimits = Field(default_factory=FileTenantLimits)


class PickerWeights(BaseModel):
    """The default policy: weights of its mix of scores (each in [0, 1]) and its load bound."""

    prefix: float = Field(default=3.0, ge=0)
    kv: float = Field(default=0.5, ge=0)
    load: float = Field(default=1.0, ge=0)
    room: float = Field(default=1.0, ge=0)
    backlog: float = Field(default=1.0, ge=0, description="few uncached prompt tokens still prefilling")
    balance_factor: float = Field(default=1.0, ge=0, description="ε of the load bound ceil((1+ε)·mean)")
    balance_slack: int = Field(default=2, ge=0, description="requests allowed over that bound")


class RouterConfig(BaseModel):
    """Everything one router process is told; validated once, passed everywhere."""

    model_config = ConfigDict(extra="forbid")

    engines: list[str] = Field(
        default_factory=list, description="static engines: base URLs, each optionally KIND=URL"
    )
    engine_kind: str = Field(
        default=DEFAULT_ENGINE_KIND, description="the kind of the static engines whose entry names none"
    )
    tenants: list[TenantEntry] = Field(default_factory=list)
    kubernetes: bool = False
    namespace: str | None = Field(default=None, description="None: every namespace")
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    policy: str = "default"
    picker_weights: PickerWeights = Field(default_factory=PickerWeights)
    prefix_chunk_chars: int = Field(default=64, ge=1, description="characters per prefix-index block")
    prefix_index_blocks: int = Field(default=200_000, ge=1)
    shared_prefix_cache: bool = Field(
        default=False,
        description="tenants share prefix-cache blocks on models no InferenceService describes "
        "(else each tenant's requests carry its own cache_salt)",
    )
    chars_per_token: float = Field(default=4.0, gt=0, description="prompt token estimate at admission")
    prefill_rate_prior: float = Field(
        default=100.0, gt=0, description="prompt tokens/s an engine prefills, until a first byte says"
    )
    default_max_tokens: int = Field(default=256, ge=1)
    max_request_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES, ge=1, description="a larger request body gets a 413 before it is read"
    )
    load_interval_s: float = Field(default=0.2, gt=0)
    adapters_interval_s: float = Field(
        default=10.0, gt=0, description="how often an engine's adapters are re-read"
    )
    load_stale_s: float = Field(default=3.0, gt=0, description="older loads are not trusted")
    load_timeout_s: float = Field(default=1.0, gt=0, description="a slower /load answer is skipped")
    engine_silent_s: float = Field(default=10.0, gt=0, description="no answer for this long: unready")
    engine_connect_timeout_s: float = Field(default=2.0, gt=0)
    engine_read_timeout_s: float = Field(
        default=60.0, gt=0, description="first byte and idle stream: the engine sent nothing for this long"
    )
    stream_stall_timeout_s: float = Field(
        default=30.0, gt=0, description="a client that reads nothing of its stream for this long: aborted"
    )
    stream_send_buffer_kib: int = Field(
        default=256, ge=4, description="each client connection's kernel send buffer (KiB)"
    )
    max_retries: int = Field(default=2, ge=0)
    saturation_kv_usage: float = Field(default=0.95, gt=0, le=1)
    max_engine_queue: int = Field(default=4, ge=0, description="requests past max_num_seqs per engine")
    admission: bool = Field(default=True, description="False: never queue, send to an engine at once")
    max_queue_wait_s: float = Field(default=10.0, gt=0)
    cold_start_wait_s: float = Field(
        default=180.0, gt=0, description="queue deadline while scaling from zero"
    )
    max_queue_len: int = Field(default=1024, ge=0)
    slo: SLOSpec = Field(default_factory=SLOSpec, description="SLO of models no InferenceService describes")
    autoscale_interval_s: float = Field(default=5.0, gt=0)
    redis_lease_s: float = Field(default=900.0, gt=0, description="a concurrency slot's expiry")
    envoy: GatewayConfig | None = Field(default=None, description="Envoy gateway mode (--envoy-xds-port)")
    usage_log: str | None = Field(
        default=None, description="one JSON line per finished request: a file, '-': stdout"
    )
    usage_log_max_bytes: int = Field(
        default=100 << 20, ge=0, description="rotate the usage log past this size; 0: never"
    )
    usage_log_backups: int = Field(default=5, ge=0, description="rotated usage logs kept (PATH.1 ... PATH.N)")
    # KV events (#48, router/kv_events_sub.py): where each engine publishes, for the precise-prefix policy
    kv_events: list[str] = Field(
        default_factory=list, description="URL=ENDPOINT[,REPLAY]: an engine's KV event (and replay) sockets"
    )
    kv_events_port: int | None = Field(
        default=None, ge=1, le=65534, description="every other engine: tcp://<its host>:PORT, replay PORT+1"
    )
    kv_index_blocks: int = Field(default=1_000_000, ge=1, description="the KV index's cap, all engines")
    kv_events_stale_s: float = Field(
        default=30.0, gt=0, description="a busy engine silent this long is scored without its events"
    )
    vllm_hash_seed: str = Field(
        default="vllm-none-hash", description="the PYTHONHASHSEED vLLM engines run with (sha256_cbor)"
    )

    @field_validator("engines")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return [engine_entry(u) for u in urls]

    @field_validator("kv_events")
    @classmethod
    def _kv_events(cls, entries: list[str]) -> list[str]:
        from kvfleet.router.kv_events_sub import parse_kv_events_entry

        for entry in entries:
            parse_kv_events_entry(entry)
        return entries

    @field_validator("engine_kind")
    @classmethod
    def _kind(cls, kind: str) -> str:
        return known_kind(kind, "engine kind")


def known_kind(kind: str, what: str) -> str:
    if kind not in ENGINE_KINDS:
        raise ValueError(f"{what} {kind!r} is unknown: choose one of {', '.join(ENGINE_KINDS)}")
    return kind


def engine_entry(entry: str) -> str:
    """One static engine, ``[KIND=]URL`` (kinds: :data:`kvfleet.protocol.ENGINE_KINDS`), checked and normalised."""
    kind, sep, url = entry.partition("=")
    if not sep or "://" in kind:
        kind, url = "", entry
    if kind:
        known_kind(kind, f"engine entry {entry!r}: kind")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine URL {url!r} must start with http:// or https://")
    return f"{kind}={url.rstrip('/')}" if kind else url.rstrip("/")


def stream_bounds(args: Any) -> dict[str, Any]:
    """The RouterConfig fields of the flags ``kvfleet router`` and ``kvfleet up`` share for slow and silent peers."""
    return {
        "engine_read_timeout_s": args.engine_read_timeout,
        "stream_stall_timeout_s": args.stream_stall_timeout,
        "stream_send_buffer_kib": args.stream_send_buffer,
    }


def load_tenants_file(path: Path) -> list[TenantEntry]:
    """Read a ``tenants:`` YAML file; errors name the entry and the field."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"tenants file {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list):
        raise ConfigError(f"tenants file {path}: expected a mapping with a 'tenants:' list")
    entries: list[TenantEntry] = []
    for i, raw in enumerate(doc["tenants"]):
        try:
            entries.append(TenantEntry.model_validate(raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"tenants file {path}: tenants[{i}].{field}: {first['msg']}") from exc
    names = [e.tenant for e in entries]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"tenants file {path}: tenant {name!r} appears more than once")
    keys = [e.api_key for e in entries]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"tenants file {path}: two tenants share one apiKey")
    return entries
