"""`kvfleet up`'s command line: its arguments, their checks (a one-line reason or None), the tenants it
serves and the model fetched once before any engine starts. :mod:`kvfleet.router.local` runs the fleet."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvfleet import capacity
from kvfleet.router.config import ConfigError, TenantEntry, load_tenants_file
from kvfleet.streaming import add_stream_arguments

LOCAL_TENANT = "local"
LOCAL_API_KEY = "sk-kvfleet-local"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="engines to start (default 2)")
    parser.add_argument(
        "--model", default="tiny", help="'tiny', 'smollm2', a .gguf file or a Hugging Face checkpoint folder"
    )
    parser.add_argument(
        "--served-model-name", help="the model name clients ask for (default: the folder name)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="the router's port: the fleet's one endpoint")
    parser.add_argument("--tenants", type=Path, help="tenants YAML file; default: one local tenant")
    parser.add_argument(
        "--simulate", action="store_true", help="simulated engines (timing model, no weights)"
    )
    parser.add_argument(
        "--min-replicas", type=int, help="autoscale between --min-replicas and --max-replicas"
    )
    parser.add_argument("--max-replicas", type=int)
    parser.add_argument("--target-queue-depth", type=int, default=4)
    parser.add_argument("--policy", default="default", help="routing policy")
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG", help="extra `kvfleet engine` argument"
    )
    parser.add_argument(
        "--engine-read-timeout", type=float, default=60.0, help="the router's --engine-read-timeout (seconds)"
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        help="the engines' --tool-call-parser (hermes, llama3_json, mistral, qwen)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="the engines' --enable-auto-tool-choice"
    )
    add_stream_arguments(parser)  # the router's; the engines take theirs with --engine-arg
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def tool_flags(args: argparse.Namespace) -> list[str]:
    """The tool-calling flags every engine of the fleet gets."""
    flags = [] if args.tool_call_parser is None else ["--tool-call-parser", args.tool_call_parser]
    return flags + (["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else [])


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model in ("tiny", "smollm2"):
        return str(args.model)
    path = Path(args.model).expanduser().resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def validate(args: argparse.Namespace) -> str | None:
    if args.replicas < 0:
        return f"--replicas must be >= 0, got {args.replicas}"
    low = args.replicas if args.min_replicas is None else args.min_replicas
    high = max(args.replicas, low) if args.max_replicas is None else args.max_replicas
    if not 0 <= low <= high:
        return f"need 0 <= --min-replicas ({low}) <= --max-replicas ({high})"
    if high < 1:
        return "need --max-replicas >= 1 (an InferenceService's maxReplicas): 0 engines could never serve"
    if not low <= args.replicas <= high:
        return f"--replicas {args.replicas} is outside [{low}, {high}]"
    if args.simulate:
        return _simulated_model_error(args)
    named = args.model in ("tiny", "smollm2") or Path(args.model).expanduser().is_dir()
    if not (named or Path(args.model).expanduser().is_file()):
        return f"--model {args.model!r} is neither 'tiny', 'smollm2', a .gguf file nor a checkpoint folder"
    return None


def _simulated_model_error(args: argparse.Namespace) -> str | None:
    """What a simulated engine would refuse at start (its timing model needs the model's shape), said once."""
    if args.model == "tiny" or any(a.startswith("--sim-model") for a in args.engine_arg):
        return None
    try:
        capacity.resolve_model(args.model)
    except capacity.CapacityError as exc:
        return f"--model with --simulate: {exc}"
    return None


def local_tenants(args: argparse.Namespace) -> tuple[list[TenantEntry], str | None]:
    """The tenants file's entries (or the one local tenant), or why the file cannot be used."""
    if not args.tenants:
        return [TenantEntry.model_validate({"tenant": LOCAL_TENANT, "apiKey": LOCAL_API_KEY})], None
    try:
        return load_tenants_file(args.tenants), None
    except ConfigError as exc:
        return [], str(exc)


def fetch_model(model: str, timeout_s: float = 900.0) -> str | None:
    """Fetch/convert ``model`` into the cache once (``kvfleet fetch``), before any engine starts;
    the one-line reason it could not be, or None. Run as a process: the router never imports the engine."""
    argv = [sys.executable, "-m", "kvfleet.cli", "fetch", model]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"fetching {model!r} took over {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1].removeprefix("kvfleet fetch: ") if lines else f"kvfleet fetch exited {done.returncode}"
