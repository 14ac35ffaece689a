"""``kvfleet engine``: serve one model with the paged-KV engine over the OpenAI API (docs/architecture.md §3, §5).

Where it sits: ``kvfleet.cli`` dispatches here; :func:`run` turns the flags into one
validated ``EngineConfig`` (plus the simulator's settings), builds the runner (the real
model, or ``--simulate``'s timing model), wraps the ``Engine`` in the HTTP app and serves
it until SIGTERM drains it. This module imports nothing heavy at import time, and the
simulated path never imports torch.
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import sys
from typing import TYPE_CHECKING, Any

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.flags import same_named
from kvfleet.protocol import DEFAULT_BLOCK_SIZE, DEFAULT_ENGINE_PORT

if TYPE_CHECKING:
    from kvfleet.engine.client.core_client import CoreTransport
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.core.engine import Engine
    from kvfleet.engine.server.state import ServerState, ToolSettings
    from kvfleet.engine.sim_lora import SimAdapters
    from kvfleet.engine.tokenizer.base import Tokenizer

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def byte_size(text: str) -> int:
    """``8589934592``, ``8GiB``, ``512MiB``, ``16G`` → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 8589934592, 8GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _server_arguments(parser)
    _scheduling_arguments(parser)
    _cache_arguments(parser)
    _execution_arguments(parser)
    _parallel_arguments(parser)
    _lora_arguments(parser)
    _sim_arguments(parser)
    _tool_arguments(parser)


def _tool_arguments(parser: argparse.ArgumentParser) -> None:
    from kvfleet.engine.server.tool_parsers import PARSERS

    t = parser.add_argument_group("tool calling")
    t.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how the model writes tool calls (tool_choice auto reads them with it): hermes (also the "
        "prompt kvfleet renders for templates without tools), llama3_json, mistral, qwen",
    )
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice 'auto' (needs --tool-call-parser); 'required' and named choices always work",
    )


def tool_settings(args: argparse.Namespace) -> ToolSettings:
    """The server's ToolSettings; ``--enable-auto-tool-choice`` without a parser is a ValueError."""
    from kvfleet.engine.server.state import ToolSettings

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral, qwen)"
        )
    return ToolSettings(parser=args.tool_call_parser, auto=args.enable_auto_tool_choice)


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    from kvfleet.streaming import add_stream_arguments

    g = parser.add_argument_group("model and server")
    g.add_argument(
        "--model",
        default="tiny",
        help="a Hugging Face checkpoint folder, a .gguf file, 'tiny' (the embedded model) "
        "or 'smollm2' (SmolLM2-135M-Instruct, fetched once)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the name clients send as 'model' (default: the folder's)"
    )
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0, as in a pod)")
    g.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT)
    g.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for running requests"
    )
    add_stream_arguments(g)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--max-request-bytes",
        type=byte_size,
        default=8 << 20,
        help="request bodies over this size get a 413 before they are read (default 8MiB)",
    )
    g.add_argument(
        "--engine-core",
        default="process",
        choices=["process", "thread"],
        help="run the engine loop in its own process (default) or in a thread of the HTTP server",
    )


def _scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("scheduling")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="hard cap on a step's tokens")
    e.add_argument(
        "--no-stall-free",
        action="store_true",
        help="plan steps by --max-num-batched-tokens alone: a burst of prompts stalls the running streams "
        "(default: stall-free, prefill chunks sized by a time bound on each step)",
    )
    e.add_argument(
        "--stall-free-factor",
        type=float,
        default=2.0,
        metavar="K",
        help="stall-free: a step with prefill takes at most K times a decode step: the running decodes', or "
        "the one midway to the batch they make with the prompts waiting, whichever is more (predicted by a "
        "cost model fitted to the measured steps); prefill gets the rest, less the 0.9 quantile of the model's "
        "overrun (default 2)",
    )
    e.add_argument(
        "--no-profile-step-cost",
        action="store_true",
        help="stall-free: do not time synthetic steps at start (the cost model then learns from the first steps)",
    )
    e.add_argument(
        "--target-step-ms",
        type=float,
        default=None,
        metavar="MS",
        help="stall-free: a step may always take MS (the deployment's decode gap SLO), prefill filling it "
        "when the decodes are cheap; the bound is max(MS, K x the decodes' step) (default: none)",
    )
    e.add_argument("--scheduling-policy", default="fcfs", help="a registered policy: fcfs, priority")
    e.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule and launch the next step before reading this one's tokens (engine/core/async_scheduling.py)",
    )


def _cache_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("KV cache and memory")
    e.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    mem = e.add_mutually_exclusive_group()
    mem.add_argument(
        "--kv-cache-memory", type=byte_size, default=None, metavar="BYTES", help="KV cache size (8GiB)"
    )
    mem.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    e.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (wins over memory)")
    e.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")


def _execution_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("model execution")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    e.add_argument("--device", default="auto", help="cuda, cpu or auto")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "torch", "triton", "cpu"],
        help="attention backend (auto: the native cpu kernel on a CPU where it builds, else torch)",
    )
    e.add_argument(
        "--no-prepack-weights",
        action="store_true",
        help="CPU float32: do not keep the linears packed for a GEMM library (saves about one copy of their memory)",
    )
    e.add_argument(
        "--weight-packing",
        default="auto",
        choices=["auto", "mkl", "onednn", "native"],
        help="CPU float32: the GEMM library the packed linears run on (auto: the faster here, timed at load)",
    )
    e.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "int8", "fp8"],
        help="default: inferred from the checkpoint (a quantised .gguf in its blocks, a compressed-tensors "
        "or fp8 one in its scheme, else float); gguf: the blocks of smollm2 or a .gguf; int8/fp8: quantise at load",
    )
    e.add_argument(
        "--structured-outputs-compile-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a structured-output request whose grammar is not compiled in S seconds is a 400",
    )
    e.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode steps without CUDA graphs (engine/runner/cuda_graphs.py)",
    )
    e.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="decode batch sizes captured as CUDA graphs (default: 1 2 4 8 16 ... up to --max-num-seqs)",
    )


def _parallel_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("tensor parallelism")
    e.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks, one process each (engine/parallel; cuda:0..N-1 on a GPU host)",
    )
    e.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=30.0,
        metavar="S",
        help="with -tp > 1: a collective (or the group's set-up) that does not finish in S seconds fails",
    )


def _lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters (PEFT folders; a request names one as its model)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters loaded at start (implies --enable-lora)",
    )
    lora.add_argument(
        "--enable-lora", action="store_true", help="serve adapters (POST /v1/load_lora_adapter at run time)"
    )
    lora.add_argument("--max-loras", type=int, default=1, help="adapters resident on the device at once")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    lora.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory (default: --max-loras)"
    )


def _sim_arguments(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("simulated mode (no model, no torch: a timing model on the real scheduler)")
    s.add_argument("--simulate", action="store_true", help="replace the model with a timing model")
    s.add_argument(
        "--sim-gpu", default="h100", help="GPU whose datasheet times the steps (h100, a100, l4, ...)"
    )
    s.add_argument("--sim-model", help="model whose shape times the steps (default: --model, or llama-3-8b)")
    s.add_argument(
        "--sim-speedup", type=float, default=1.0, help="run the simulated clock this many times faster"
    )
    s.add_argument(
        "--sim-base-ms", type=float, default=None, help="fixed cost of a step (default: weights / bandwidth)"
    )
    s.add_argument(
        "--sim-per-token-ms", type=float, default=None, help="cost per batched token (default: compute)"
    )
    s.add_argument(
        "--sim-lora-load-ms",
        type=float,
        default=50.0,
        help="simulated time to load a non-resident adapter onto the device",
    )
    s.add_argument(
        "--sim-per-context-token-us", type=float, help="cost per token of context read (default: KV bytes)"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The one validated config of this process (pydantic names the bad flag's field)."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.lora.config import parse_lora_modules

    return EngineConfig(
        **same_named(args, EngineConfig)
        | {
            "device": "cpu" if args.simulate else args.device,
            "enable_prefix_caching": not args.no_prefix_caching,
            "stall_free": not args.no_stall_free,
            "profile_step_cost": not args.no_profile_step_cost,
            "prepack_weights": not args.no_prepack_weights,
            "attention_backend": args.attention,
            "lora_modules": parse_lora_modules(args.lora_modules),
        }
    )


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the flags describe (in the core process; picklable as ``partial(build_engine, args)``)."""
    if args.simulate:
        from kvfleet.engine.sim import build_simulated

        return build_simulated(args, engine_config(args))
    from kvfleet.engine.core.engine import Engine

    return Engine(engine_config(args))  # builds the model runner and the tokenizer from the config


def api_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer the API process encodes with: the checkpoint's, without loading the model (no torch)."""
    if args.simulate:
        from kvfleet.engine.tokenizer.byte_level import ByteTokenizer

        return ByteTokenizer()
    from kvfleet.engine.loader.sources import resolve_model
    from kvfleet.engine.tokenizer.hf import HFTokenizer

    return HFTokenizer(resolve_model(args.model))


def build_server_state(args: argparse.Namespace) -> ServerState:
    """The server's state over an engine core: its own process (``--engine-core process``) or a thread."""
    from kvfleet.engine.server.app import build_state

    tools = tool_settings(args)  # a bad flag fails before any spawn
    core: CoreTransport
    if args.engine_core == "thread":
        from kvfleet.engine.client.core_client import ThreadCore

        engine = build_engine(args)
        core, tokenizer = ThreadCore(engine), engine.tokenizer
        name, max_model_len = engine.model_name, engine.max_model_len
    else:
        from kvfleet.engine.client.core_client import ProcessCore

        tokenizer = api_tokenizer(args)  # a missing or broken checkpoint fails here, before any spawn
        process = ProcessCore(functools.partial(build_engine, args))
        hello = process.launch()
        core, name, max_model_len = process, hello.model_name, hello.max_model_len
    state = build_state(
        core,
        tokenizer,
        name=name,
        max_model_len=max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
    )
    state.tools = tools
    return state


def sim_adapters(args: argparse.Namespace) -> SimAdapters | None:
    """The simulated engine's adapters (``--simulate --lora-modules ...``), or None."""
    if not (args.simulate and args.lora_modules):
        return None
    from kvfleet.engine.lora.config import parse_lora_modules
    from kvfleet.engine.sim_lora import SimAdapters

    load_s = args.sim_lora_load_ms / 1e3 / args.sim_speedup if args.sim_speedup > 0 else 0.0
    return SimAdapters(parse_lora_modules(args.lora_modules), args.max_loras, load_s)


def run(args: argparse.Namespace) -> int:
    from kvfleet.tracing import settings_from_env

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.stream_stall_timeout <= 0 or args.stream_send_buffer < 4:
        print(
            "kvfleet engine: need --stream-stall-timeout > 0 and --stream-send-buffer >= 4 (KiB), got "
            f"{args.stream_stall_timeout} and {args.stream_send_buffer}",
            file=sys.stderr,
        )
        return 2
    try:
        settings_from_env("kvfleet-engine")  # a bad OTEL_* variable is refused before the model loads
        adapters = sim_adapters(args)
        state = build_server_state(args)
    except (ValueError, OSError, ModelLoadError) as exc:  # a bad flag, an unknown GPU/model, a bad checkpoint
        print(f"kvfleet engine: {_one_line(exc)}", file=sys.stderr)
        return 2
    state.stream_stall_timeout_s = args.stream_stall_timeout
    from kvfleet.engine.server.app import create_app
    from kvfleet.engine.server.serve import serve

    app = create_app(state, max_body_bytes=args.max_request_bytes)
    if adapters is not None:
        from kvfleet.engine.sim_lora import SimLoraMiddleware

        app.add_middleware(SimLoraMiddleware, adapters=adapters, base_model=state.model.name)
    return serve(
        app,
        state,
        host=args.host,
        port=args.port,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        send_buffer_kib=args.stream_send_buffer,
    )


def _one_line(exc: Any) -> str:
    return " ".join(str(exc).split())
