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
import sys
from typing import TYPE_CHECKING, Any

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.server.flags import add_arguments, byte_size
from kvfleet.engine.server.pooling_flags import runner_of
from kvfleet.engine.server.response_store import store_from_args
from kvfleet.flags import same_named

# kvfleet.cli builds the parser through here; the flags themselves are engine/server/flags.py's
__all__ = ["add_arguments", "byte_size", "build_engine", "engine_config", "run", "tool_settings"]

if TYPE_CHECKING:
    from kvfleet.engine.client.core_client import CoreTransport
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.core.engine import Engine
    from kvfleet.engine.server.state import ServerState, ToolSettings
    from kvfleet.engine.sim_lora import SimAdapters
    from kvfleet.engine.tokenizer.base import Tokenizer


def tool_settings(args: argparse.Namespace) -> ToolSettings:
    """The server's ToolSettings; ``--enable-auto-tool-choice`` without a parser is a ValueError."""
    from kvfleet.engine.server.state import ToolSettings

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral, qwen)"
        )
    return ToolSettings(
        parser=args.tool_call_parser,
        auto=args.enable_auto_tool_choice,
        reasoning_parser=getattr(args, "reasoning_parser", None),
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
            "runner": runner_of(args),
        }
    )


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the flags describe (in the core process; picklable as ``partial(build_engine, args)``)."""
    from kvfleet.engine.kv_events import attach

    if args.simulate:
        from kvfleet.engine.sim import build_simulated

        engine = build_simulated(args, engine_config(args))
    else:
        from kvfleet.engine.core.engine import Engine

        engine = Engine(engine_config(args))  # builds the model runner and the tokenizer from the config
    attach(engine, args.kv_events_config)  # --kv-events-config: the pool's events over ZMQ
    return engine


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
        runner=runner_of(args),
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
        responses = store_from_args(args)
        settings_from_env("kvfleet-engine")  # a bad OTEL_* variable is refused before the model loads
        adapters = sim_adapters(args)
        state = build_server_state(args)
    except (ValueError, OSError, ModelLoadError) as exc:  # a bad flag, an unknown GPU/model, a bad checkpoint
        print(f"kvfleet engine: {_one_line(exc)}", file=sys.stderr)
        return 2
    state.stream_stall_timeout_s = args.stream_stall_timeout
    state.responses = responses
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
