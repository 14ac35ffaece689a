"""The ``kvfleet`` command line (docs/architecture.md §3): one sub-command per part.

Each sub-command lives in its part as a module with ``add_arguments(parser)`` and
``run(args) -> int``; only the chosen one is imported, so ``kvfleet router`` never
loads torch. Those modules must stay light at import time.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvfleet.router.local", "local fleet: engines + router, no cluster"),
    "engine": ("kvfleet.engine.cli", "serve one model with the paged-KV engine (OpenAI API)"),
    "fetch": (
        "kvfleet.engine.loader.fetch",
        "fetch or convert a model (tiny, smollm2, .gguf) into the cache",
    ),
    "router": ("kvfleet.router.cli", "the multi-tenant, KV- and prefix-aware router"),
    "operator": ("kvfleet.operator.cli", "the kopf operator for InferenceService and TenantQuota"),
    "bench": ("kvfleet.bench.cli", "load-test any OpenAI-compatible endpoint"),
    "plan": ("kvfleet.plan", "capacity maths: what fits on which GPU"),
}


def _load(name: str) -> ModuleType:
    return importlib.import_module(SUBCOMMANDS[name][0])


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description="Serve LLMs on Kubernetes.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            _load(name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = args_list[0] if args_list and args_list[0] in SUBCOMMANDS else None
    parser = build_parser(only=chosen) if chosen else build_parser()
    args = parser.parse_args(args_list)
    return int(_load(args.command).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
