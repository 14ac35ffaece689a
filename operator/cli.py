"""`kvfleet operator`: the kopf operator for InferenceService and TenantQuota (docs/architecture.md §3, §7)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pydantic import ValidationError

from .config import DEFAULT_PEERING_NAME, ENGINE_IMAGE_ENV, OperatorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--engine-image", default=None, help="one image for every service without spec.engine.image"
    )
    for variant, env in ENGINE_IMAGE_ENV.items():
        parser.add_argument(
            f"--engine-image-{variant}",
            default=None,
            help=f"image when spec.engine.image is unset and spec.resources.gpus "
            f"{'> 0' if variant == 'cuda' else '= 0'} (default: ${env}, else kvfleet-engine-{variant}:VERSION)",
        )
    parser.add_argument(
        "--vllm-image",
        default=None,
        help="image of spec.engine.kind vllm services without spec.engine.image (default vllm/vllm-openai:v0.32.0)",
    )
    parser.add_argument(
        "--engine-shm-per-gpu",
        default=None,
        metavar="QUANTITY",
        help="/dev/shm per GPU of a tensor-parallel engine pod (spec.resources.gpus > 1), e.g. 2Gi (default)",
    )
    parser.add_argument(
        "--otel-endpoint",
        default=None,
        metavar="URL",
        help="an OTLP collector: engine pods get OTEL_* variables and export their traces there",
    )
    parser.add_argument("--otel-protocol", default=None, choices=["http/protobuf", "grpc"])
    parser.add_argument(
        "--standalone", action="store_true", help="no peering: act even if other replicas run"
    )
    parser.add_argument(
        "--peering-name", default=DEFAULT_PEERING_NAME, help="the KopfPeering object replicas share"
    )
    parser.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    parser.add_argument(
        "--liveness", default=None, help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--router-namespace",
        default=None,
        help="each InferenceService's NetworkPolicy admits the router's and the gateway's pods of this "
        "namespace only (default: of any namespace)",
    )
    parser.add_argument(
        "--metrics-from",
        action="append",
        default=[],
        type=_json_object,
        metavar="JSON",
        help="a NetworkPolicyPeer (JSON) also admitted to the engine port, e.g. Prometheus (repeatable)",
    )
    parser.add_argument(
        "--no-network-policy", action="store_true", help="render no NetworkPolicy for the engine pods"
    )
    parser.add_argument("--verbose", "-v", action="store_true")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    fields = {
        "namespaces": tuple(args.namespace),
        "all_namespaces": args.all_namespaces,
        "standalone": args.standalone,
        "peering_name": args.peering_name,
        "liveness_endpoint": args.liveness,
        "network_policy": not args.no_network_policy,
        "metrics_from": tuple(args.metrics_from),
    }
    optional = {
        "engine_image": args.engine_image,
        "engine_image_cpu": args.engine_image_cpu,
        "engine_image_cuda": args.engine_image_cuda,
        "vllm_image": args.vllm_image,
        "engine_shm_per_gpu": args.engine_shm_per_gpu,
        "otel_endpoint": args.otel_endpoint,
        "otel_protocol": args.otel_protocol,
        "priority": args.priority,
        "router_namespace": args.router_namespace,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return OperatorConfig.model_validate(fields)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        print(f"kvfleet operator: {where + ': ' if where else ''}{err['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    from .runtime import run as run_operator  # kopf loads only when the operator really runs

    run_operator(config)
    return 0
