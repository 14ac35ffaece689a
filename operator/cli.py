"""`kvfleet operator`: the kopf operator for InferenceService and TenantQuota (docs/architecture.md §3, §7)."""

from __future__ import annotations

import argparse
import logging
import sys

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
        "--standalone", action="store_true", help="no peering: act even if other replicas run"
    )
    parser.add_argument(
        "--peering-name", default=DEFAULT_PEERING_NAME, help="the KopfPeering object replicas share"
    )
    parser.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    parser.add_argument(
        "--liveness", default=None, help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument("--verbose", "-v", action="store_true")


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    fields = {
        "namespaces": tuple(args.namespace),
        "all_namespaces": args.all_namespaces,
        "standalone": args.standalone,
        "peering_name": args.peering_name,
        "liveness_endpoint": args.liveness,
    }
    optional = {
        "engine_image": args.engine_image,
        "engine_image_cpu": args.engine_image_cpu,
        "engine_image_cuda": args.engine_image_cuda,
        "priority": args.priority,
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
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    from .runtime import run as run_operator  # kopf loads only when the operator really runs

    run_operator(config)
    return 0
