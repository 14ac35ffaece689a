"""`kvfleet router` (docs/architecture.md §3): flags → one :class:`RouterConfig` → :func:`build_app` on uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from kvfleet.router.gateway_config import GatewayConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _discovery_arguments(parser)
    _routing_arguments(parser)
    _server_arguments(parser)
    _usage_log_arguments(parser)
    _add_envoy_arguments(
        parser.add_argument_group(
            "Envoy gateway (docs/architecture.md §6; the other --envoy-* flags take effect with --envoy-xds-port)"
        )
    )


def _discovery_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("discovery: the engines and tenants the router serves")
    group.add_argument(
        "--engines",
        default="",
        help="comma-separated engine base URLs (static discovery), each optionally KIND=URL "
        "(vllm=http://10.0.0.7:8000); KIND is kvfleet or vllm",
    )
    group.add_argument(
        "--engine-kind",
        default="kvfleet",
        help="the kind of the --engines entries that name none: kvfleet (reads /load) or vllm "
        "(reads vLLM's /metrics) (default kvfleet)",
    )
    group.add_argument(
        "--tenants", type=Path, help="tenants YAML file (a 'tenants:' list of TenantQuota specs)"
    )
    group.add_argument(
        "--kubernetes", action="store_true", help="discover InferenceServices, TenantQuotas, pods"
    )
    group.add_argument("--namespace", help="with --kubernetes: watch only this namespace")
    group.add_argument("--redis", dest="redis_url", help="redis://host:port/db shared by router replicas")


def _routing_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing and admission")
    group.add_argument(
        "--policy",
        default="default",
        help="round-robin|least-request|kv-aware|prefix-aware|precise-prefix|adapter-aware|default",
    )
    group.add_argument("--no-admission", action="store_true", help="never queue: send every request at once")
    group.add_argument("--max-queue-wait", type=float, default=10.0, help="seconds a request may wait queued")
    group.add_argument(
        "--max-engine-queue", type=int, default=4, help="requests past max_num_seqs per engine"
    )
    group.add_argument(
        "--chars-per-token", type=float, default=4.0, help="prompt token estimate at admission"
    )
    group.add_argument("--prefix-chunk-chars", type=int, default=64, help="characters per prefix-index block")
    group.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="let tenants share prefix-cache blocks (public system prompts) on models without an "
        "InferenceService; otherwise each tenant's requests carry its own cache_salt",
    )
    _kv_events_arguments(group)
    group.add_argument("--slo-ttft-ms", type=int, help="TTFT target of models without an InferenceService")
    group.add_argument("--slo-tpot-ms", type=int, help="TPOT target of models without an InferenceService")


def _kv_events_arguments(group: argparse._ArgumentGroup) -> None:
    """Where engines publish their KV events (router/kv_events_sub.py), for --policy precise-prefix."""
    group.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="an engine's KV event socket and replay socket (repeat per engine)",
    )
    group.add_argument(
        "--kv-events-port",
        type=int,
        help="every other engine publishes at tcp://<its host>:PORT, replay PORT+1",
    )
    group.add_argument("--kv-index-blocks", type=int, default=1_000_000, help="the KV index's cap (entries)")
    group.add_argument(
        "--kv-events-stale", dest="kv_events_stale_s", type=float, default=30.0,
        help="seconds a busy engine may publish nothing before its entries are not trusted",
    )  # fmt: skip
    group.add_argument(
        "--vllm-hash-seed", default="vllm-none-hash", help="the PYTHONHASHSEED the vLLM engines run with"
    )


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    from kvfleet.streaming import add_stream_arguments

    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8080)
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,  # kvfleet.http_guard.DEFAULT_MAX_BODY_BYTES (not imported: this module stays light)
        help="request bodies over this many bytes get a 413 before they are read (default 8 MiB)",
    )
    group.add_argument(
        "--engine-read-timeout",
        type=float,
        default=60.0,
        help="seconds an engine may send nothing (before its first byte, or mid-stream) before the "
        "request fails with a clean error and the engine is taken out (default 60)",
    )
    add_stream_arguments(group)
    group.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _usage_log_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("usage records")
    group.add_argument(
        "--usage-log",
        metavar="PATH",
        help="write one JSON line per finished request (tenant, model, engine, tokens, timings, status, "
        "trace id; never the prompt) to PATH, '-' for stdout",
    )
    group.add_argument(
        "--usage-log-max-bytes",
        type=int,
        default=100 << 20,
        help="rotate the usage log (PATH -> PATH.1 ...) before it grows past this many bytes; 0: never",
    )
    group.add_argument("--usage-log-backups", type=int, default=5, help="rotated usage logs kept (default 5)")


def _add_envoy_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--envoy-xds-port",
        type=int,
        help="Envoy gateway mode: serve Envoy's ADS (listeners, clusters) and ext_proc on this gRPC port",
    )
    group.add_argument(
        "--envoy-xds-host",
        help="the router's address as Envoy dials it for ADS and ext_proc: an IP, or a name Envoy "
        "resolves (the router's Service); default: --host",
    )
    group.add_argument(
        "--envoy-listen-host",
        default="127.0.0.1",
        help="the address of the listener the router serves Envoy (0.0.0.0 when Envoy runs in its own pod)",
    )
    group.add_argument(
        "--envoy-port", type=int, default=10000, help="the port of that listener: where clients reach Envoy"
    )
    group.add_argument(
        "--envoy-admin-port",
        type=int,
        default=9901,
        help="Envoy's admin port (bound to 127.0.0.1) in the bootstrap --envoy-bootstrap writes",
    )
    group.add_argument(
        "--envoy-retries",
        type=int,
        default=2,
        help="engines Envoy tries after the router's choice when a connection fails before the request is sent",
    )
    group.add_argument(
        "--envoy-bootstrap",
        type=Path,
        help="write Envoy's bootstrap (JSON; start Envoy with -c FILE) to this file at start-up",
    )


def _envoy_from_args(args: argparse.Namespace) -> GatewayConfig | None:
    from kvfleet.router.gateway_config import GatewayConfig

    if args.envoy_xds_port is None:
        return None
    return GatewayConfig(
        xds_host=args.envoy_xds_host or args.host,
        xds_bind=args.host,
        xds_port=args.envoy_xds_port,
        listen_host=args.envoy_listen_host,
        listen_port=args.envoy_port,
        admin_port=args.envoy_admin_port,
        num_retries=args.envoy_retries,
        message_timeout_s=args.max_queue_wait + 5.0,  # Envoy waits out the router's admission queue
    )


def config_from_args(args: argparse.Namespace) -> object:
    from kvfleet.flags import same_named
    from kvfleet.resources import SLOSpec
    from kvfleet.router.config import RouterConfig, load_tenants_file, stream_bounds

    tenants = load_tenants_file(args.tenants) if args.tenants else []
    return RouterConfig(
        **same_named(args, RouterConfig)
        | {
            "engines": [u.strip() for u in args.engines.split(",") if u.strip()],
            "tenants": tenants,
            "admission": not args.no_admission,
            "max_queue_wait_s": args.max_queue_wait,
        },
        **stream_bounds(args),
        slo=SLOSpec(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        envoy=_envoy_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfleet.router.app import build_app
    from kvfleet.router.config import ConfigError, RouterConfig
    from kvfleet.router.picker import policy
    from kvfleet.streaming import listen_socket
    from kvfleet.tracing import settings_from_env

    try:
        config = config_from_args(args)
        assert isinstance(config, RouterConfig)
        policy(config.policy)
        settings_from_env("kvfleet-router")  # a bad OTEL_* variable (TracingConfigError) names itself
    except (ConfigError, ValidationError, ValueError) as exc:
        print(f"kvfleet router: {exc}", file=sys.stderr)
        return 2
    if config.usage_log is not None:
        from kvfleet.router.usage import UsageLogError, check_writable

        try:
            check_writable(config.usage_log)
        except UsageLogError as exc:
            print(f"kvfleet router: {exc}", file=sys.stderr)
            return 2
    if not config.engines and not config.kubernetes:
        print("kvfleet router: give --engines URL,... or --kubernetes", file=sys.stderr)
        return 2
    if args.envoy_bootstrap is not None and config.envoy is None:
        print("kvfleet router: --envoy-bootstrap needs --envoy-xds-port", file=sys.stderr)
        return 2
    if config.envoy is not None and config.port in (config.envoy.xds_port, config.envoy.listen_port):
        print(f"kvfleet router: --port {config.port} is also one of Envoy's ports", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_app(config)
    if config.envoy is not None:
        from kvfleet.router.gateway.server import attach
        from kvfleet.router.gateway.xds import write_bootstrap

        if args.envoy_bootstrap is not None:
            write_bootstrap(config.envoy, args.envoy_bootstrap)
        app = attach(app, config.envoy)
    try:
        sock = listen_socket(config.host, config.port, config.stream_send_buffer_kib)
    except OSError as exc:
        print(f"kvfleet router: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    with sock, _profiled(os.environ.get(PROFILE_ENV)):
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
    return 0


PROFILE_ENV = "KVFLEET_ROUTER_PROFILE"


@contextlib.contextmanager
def _profiled(path: str | None) -> Iterator[None]:
    """With ``KVFLEET_ROUTER_PROFILE=FILE``, cProfile the whole process and dump the stats to FILE on exit."""
    if not path:
        yield
        return
    import cProfile
    import signal

    # uvicorn re-raises the SIGTERM it caught once it has shut down; exit through Python then, so the
    # stats are written.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(path)
