"""OpenTelemetry tracing for the router and the engine server, configured by the standard ``OTEL_*`` variables.

Where it sits: shared and torch-free; :mod:`kvfleet.router.tracing` (the router's spans) and
:mod:`kvfleet.engine.server.tracing` (the engine's) call :func:`tracing_from_env` once at
start-up. Tracing is off unless ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``,
``console``) or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turn it off whatever else is set. Off, nothing of the SDK is
imported (this module imports it only inside :func:`tracing_from_env` when on) and the request
paths see ``None``. ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` is ``http/protobuf`` (the default)
or ``grpc``; anything else is a :class:`TracingConfigError` naming the variable.
``OTEL_SERVICE_NAME`` names the service (default: the caller's, ``kvfleet-router`` or
``kvfleet-engine``); the exporters read the rest of their variables themselves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROTOCOLS = ("http/protobuf", "grpc")
TRACEPARENT = "traceparent"

# OpenTelemetry GenAI semantic conventions, and kvfleet's own attributes.
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
KVFLEET_TENANT = "kvfleet.tenant"
KVFLEET_ENGINE = "kvfleet.engine"


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable kvfleet cannot honour; the message names it."""


@dataclass(frozen=True)
class TracingSettings:
    exporter: str  # "otlp" | "console"
    protocol: str  # "http/protobuf" | "grpc"
    service_name: str


def settings_from_env(default_service: str, env: Mapping[str, str] | None = None) -> TracingSettings | None:
    """What the environment asks for; None: tracing is off."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter == "none" or (not exporter and not endpoint):
        return None
    exporter = exporter or "otlp"
    if exporter not in ("otlp", "console"):
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={exporter!r}: kvfleet exports with otlp, console or none"
        )
    name = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    if not env.get(name):
        name = "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = env.get(name, "").strip() or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise TracingConfigError(f"{name}={protocol!r}: use one of {', '.join(PROTOCOLS)}")
    service = env.get("OTEL_SERVICE_NAME", "").strip() or default_service
    return TracingSettings(exporter, protocol, service)


class Tracing:
    """A tracer provider with its exporter; :meth:`shutdown` exports what is left."""

    def __init__(self, settings: TracingSettings) -> None:
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.settings = settings
        self.provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
        self.tracer = self.provider.get_tracer("kvfleet")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()

    def extract(self, headers: Mapping[str, str]) -> Any:
        """The parent context a W3C ``traceparent`` in ``headers`` names (an empty context: none)."""
        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in (TRACEPARENT, "tracestate")}
        return self._propagator.extract(carrier)

    def inject(self, span: Any) -> dict[str, str]:
        """The ``traceparent`` (and ``tracestate``) headers that make ``span`` the parent downstream."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        self.provider.shutdown()


def _exporter(settings: TracingSettings) -> Any:
    if settings.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def tracing_from_env(default_service: str) -> Tracing | None:
    """The process's tracing, or None when the environment leaves it off (then no SDK module is imported)."""
    settings = settings_from_env(default_service)
    return None if settings is None else Tracing(settings)


def ns(seconds: float) -> int:
    """Epoch seconds (``time.time()``) → the nanoseconds OpenTelemetry timestamps take."""
    return int(seconds * 1e9)
