"""Tracing's configuration (the OTEL_* variables) and its cost when off: no SDK, no span processor."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvfleet.testing.processes import kvfleet_argv
from kvfleet.tracing import TracingConfigError, settings_from_env


def test_tracing_is_off_unless_an_exporter_or_endpoint_is_named() -> None:
    assert settings_from_env("svc", {}) is None
    assert settings_from_env("svc", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None
    on = settings_from_env("svc", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert on is not None and (on.exporter, on.protocol, on.service_name) == ("otlp", "http/protobuf", "svc")
    grpc = settings_from_env("svc", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                                     "OTEL_SERVICE_NAME": "router-a"})  # fmt: skip
    assert grpc is not None and (grpc.protocol, grpc.service_name) == ("grpc", "router-a")


def test_the_sdk_disabled_or_the_none_exporter_turns_tracing_off_whatever_else_is_set() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert settings_from_env("svc", {**endpoint, "OTEL_SDK_DISABLED": "true"}) is None
    assert settings_from_env("svc", {**endpoint, "OTEL_TRACES_EXPORTER": "none"}) is None


def test_a_bad_protocol_or_exporter_is_an_error_naming_the_variable() -> None:
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        settings_from_env("svc", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(TracingConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        settings_from_env("svc", {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_the_router_refuses_a_bad_otlp_protocol_at_start_naming_it() -> None:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}
    argv = kvfleet_argv("router", "--engines", "http://127.0.0.1:1")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='thrift'" in done.stderr and "http/protobuf" in done.stderr


_OFF = textwrap.dedent(
    """
    import asyncio, sys, httpx, uvicorn
    from kvfleet.router.app import build_app
    from kvfleet.router.config import RouterConfig, TenantEntry
    from kvfleet.testing.processes import SimFlags, free_port, sim_engines
    import kvfleet.engine.server.app, kvfleet.engine.server.tracing  # the engine's request path, imported

    async def main(url):
        tenant = TenantEntry.model_validate({"tenant": "t", "apiKey": "sk-t-0123456789"})
        app = build_app(RouterConfig(engines=[url], tenants=[tenant], load_interval_s=0.05))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            for _ in range(200):
                await asyncio.sleep(0.05)
                r = await c.post("/v1/completions", headers={"Authorization": "Bearer sk-t-0123456789",
                                 "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
                                 json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True})
                if r.status_code == 200:
                    break
            assert r.status_code == 200, r.text
            assert app.state.router.tracing is None
        server.should_exit = True
        await task

    with sim_engines(1, SimFlags()) as engines:
        asyncio.run(main(engines[0].url))
    sdk = ("opentelemetry.sdk", "opentelemetry.exporter")  # fastapi itself imports the (no-op) API when present
    print(",".join(sorted(m for m in sys.modules if m.startswith(sdk))))
    """
)


def test_with_tracing_off_a_request_imports_no_otel_sdk_and_makes_no_span_processor() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _OFF], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    imported = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert imported == "", (
        f"imported with tracing off: {imported}"
    )  # so no SDK TracerProvider, no span processor
