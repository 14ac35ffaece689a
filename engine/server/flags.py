"""The ``kvfleet engine`` flags, in vLLM's names and groups, each with a help text that says what it does.

Where it sits: ``kvfleet.cli`` builds the ``kvfleet engine`` parser through
:func:`kvfleet.engine.cli.add_arguments`, which is :func:`add_arguments` here; ``engine/cli.py`` then
turns the parsed flags into one validated ``EngineConfig`` (a flag whose dest is a config field
passes by name, ``kvfleet/flags.py``). Torch-free: the API process parses its flags before any model
loads.
"""

from __future__ import annotations

import argparse
import re

from kvfleet.engine.server.pooling_flags import add_pooling_arguments
from kvfleet.kv_events import kv_events_flag
from kvfleet.protocol import DEFAULT_BLOCK_SIZE, DEFAULT_ENGINE_PORT

Group = argparse._ArgumentGroup

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
    """Every ``kvfleet engine`` flag, in one argument group per concern (as ``vllm serve --help``)."""
    _server_arguments(parser.add_argument_group("model and server"))
    _scheduling_arguments(parser.add_argument_group("scheduling"))
    _cache_arguments(parser.add_argument_group("KV cache and memory"))
    _execution_arguments(parser.add_argument_group("model execution"))
    add_pooling_arguments(parser.add_argument_group("pooling (embeddings)"))
    _parallel_arguments(parser.add_argument_group("tensor parallelism"))
    _lora_arguments(
        parser.add_argument_group("LoRA adapters (PEFT folders; a request names one as its model)")
    )
    _sim_arguments(
        parser.add_argument_group("simulated mode (no model, no torch: a timing model on the real scheduler)")
    )
    _tool_arguments(parser.add_argument_group("tool calling"))
    from kvfleet.engine.server.response_store import add_store_arguments

    add_store_arguments(parser)


def _choice(group: Group, flag: str, choices: list[str], text: str) -> None:
    """A flag that takes one of ``choices``, the first being its default."""
    group.add_argument(flag, default=choices[0], choices=choices, help=text)


def _int(group: Group, flag: str, default: int | None, text: str, metavar: str | None = None) -> None:
    """A flag that takes a whole number (a count, a size, a seed); ``None`` for a default the engine
    works out."""
    group.add_argument(flag, type=int, default=default, metavar=metavar, help=text)


def _float(group: Group, flag: str, default: float | None, text: str, metavar: str | None = None) -> None:
    """A flag that takes a number (seconds, a factor, a fraction); ``None`` for no such bound."""
    group.add_argument(flag, type=float, default=default, metavar=metavar, help=text)


def _server_arguments(g: Group) -> None:
    from kvfleet.streaming import add_stream_arguments

    g.add_argument(
        "--model",
        default="tiny",
        help="The model to serve: a Hugging Face checkpoint folder, a .gguf file (converted once into a "
        "folder, its linears served in their quantised blocks), 'tiny' (the embedded random Llama, for "
        "tests) or 'smollm2' (SmolLM2-135M-Instruct, fetched once into the kvfleet cache).",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="The model name clients send as 'model' and /v1/models lists. Default: the checkpoint "
        "folder's name.",
    )
    g.add_argument("--host", default="0.0.0.0", help="The address to bind. Default: 0.0.0.0, as in a pod.")
    _int(g, "--port", DEFAULT_ENGINE_PORT, "The port to serve the HTTP API on.")
    _float(
        g,
        "--drain-timeout",
        30.0,
        "On SIGTERM the server stops accepting requests and waits up to this many seconds for the "
        "running ones to finish before it exits.",
    )
    add_stream_arguments(g)
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="The logging level of the engine and the HTTP server.",
    )
    g.add_argument(
        "--max-request-bytes",
        type=byte_size,
        default=8 << 20,
        help="A request body larger than this gets a 413 before it is read. Accepts sizes such as 8MiB. "
        "Default: 8MiB.",
    )
    _choice(
        g,
        "--engine-core",
        ["process", "thread"],
        "Where the engine loop runs: in a process of its own (the default, so tokenization and HTTP "
        "never wait on a step) or in a thread of the HTTP server's process.",
    )


def _scheduling_arguments(e: Group) -> None:
    _int(e, "--max-num-seqs", 256, "The maximum number of sequences processed in a single step.")
    _int(
        e,
        "--max-num-batched-tokens",
        2048,
        "The maximum number of tokens processed in a single step, prompt chunks and decodes together; "
        "a hard cap, whatever the stall-free bound allows.",
    )
    e.add_argument(
        "--no-stall-free",
        action="store_true",
        help="Plan steps by --max-num-batched-tokens alone, so a burst of prompts stalls the running "
        "streams. By default scheduling is stall-free: prefill chunks are sized by a time bound on each "
        "step, so decoding streams keep their pace while prompts are admitted.",
    )
    _float(
        e,
        "--stall-free-factor",
        2.0,
        "Stall-free: a step with prefill takes at most K times a decode step, the running decodes' "
        "own or the one midway to the batch they make with the prompts waiting, whichever is more, as "
        "predicted by a cost model fitted to the measured steps. Prefill gets the rest of the step, less "
        "the 0.9 quantile of the model's overrun. Default: 2.",
        metavar="K",
    )
    e.add_argument(
        "--no-profile-step-cost",
        action="store_true",
        help="Stall-free: do not time synthetic steps at start. The cost model then learns from the first "
        "steps served, and the first bursts may be planned on a guess.",
    )
    _float(
        e,
        "--target-step-ms",
        None,
        "Stall-free: a step may always take MS milliseconds (the deployment's decode gap SLO), "
        "prefill filling it while the decodes are cheap; the bound is max(MS, K times the decodes' "
        "step). Default: no time target, as a time target trades time to first token for inter-token "
        "latency.",
        metavar="MS",
    )
    e.add_argument(
        "--scheduling-policy",
        default="fcfs",
        help="The scheduling policy, by its registered name: fcfs (first come, first served) or priority "
        "(the request's priority, then its arrival).",
    )
    e.add_argument(
        "--async-scheduling",
        action="store_true",
        help="Plan and launch the next step before reading the current step's tokens, so the host's work "
        "for one step overlaps the device's for the other. Requests whose sampling needs the previous "
        "token on the host (penalties, logprobs, structured outputs) still run one step at a time.",
    )


def _cache_arguments(e: Group) -> None:
    _int(
        e,
        "--block-size",
        DEFAULT_BLOCK_SIZE,
        "The size of a KV cache block, in tokens; the unit of paging and of prefix caching.",
    )
    mem = e.add_mutually_exclusive_group()
    mem.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=None,
        metavar="BYTES",
        help="The KV cache size in bytes (accepts sizes such as 8GiB), in place of a fraction of the "
        "device's memory.",
    )
    _float(
        mem,
        "--gpu-memory-utilization",
        0.9,
        "The fraction of the GPU's memory, from 0 to 1, the engine may use for the weights, the "
        "activations and the KV cache; the cache gets what the others leave. Default: 0.9.",
        metavar="F",
    )
    _int(e, "--num-kv-blocks", None, "The exact number of KV cache blocks, overriding both memory flags.")
    _int(
        e,
        "--max-model-len",
        None,
        "The model's context length, prompt and output together. Default: the checkpoint's, as far "
        "as its rope scaling stretches it.",
    )
    e.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="Turn the prefix cache off, so requests that share a prompt prefix do not share its KV blocks.",
    )
    e.add_argument(
        "--kv-events-config",
        type=kv_events_flag,
        default=None,
        metavar="JSON",
        help="Publish the KV cache's events as vLLM does (engine/kv_events): JSON with "
        "enable_kv_cache_events, publisher (zmq|null), endpoint (default tcp://*:5557), replay_endpoint, "
        "buffer_steps, hwm, max_queue_size, topic.",
    )


def _execution_arguments(e: Group) -> None:
    _choice(
        e,
        "--dtype",
        ["auto", "float32", "float16", "bfloat16"],
        "The data type of the weights and activations. 'auto', as vLLM's: on a CPU a 16-bit checkpoint (its "
        "torch_dtype bfloat16/float16; a GGUF of F16/BF16 tensors) in bfloat16 where the CPU has AMX-BF16 or "
        "AVX512-BF16, else float32; a float32 or quantized one (GGUF blocks as smollm2's Q4_1, int8, fp8) in "
        "float32; bfloat16 on a GPU. The start-up line says which was chosen and why.",
    )
    e.add_argument(
        "--device", default="auto", help="The device to run on: cuda, cpu or auto (cuda where present)."
    )
    _int(
        e,
        "--seed",
        0,
        "The seed of the sampler's random generator, which draws the tokens of requests that send "
        "no seed of their own.",
    )
    _choice(
        e,
        "--attention",
        ["auto", "torch", "triton", "cpu"],
        "The attention backend. 'auto' takes the native cpu kernel on a CPU where it builds, else torch.",
    )
    e.add_argument(
        "--no-prepack-weights",
        action="store_true",
        help="CPU float32: do not keep the linear layers packed for a GEMM library, which saves about one "
        "copy of their memory and costs speed.",
    )
    _choice(
        e,
        "--weight-packing",
        ["auto", "mkl", "onednn", "native"],
        "CPU float32: the GEMM library the packed linear layers run on. 'auto' takes the faster one "
        "on this machine, timed at load.",
    )
    e.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "int8", "fp8"],
        help="The method used to quantise the weights. By default it is inferred from the checkpoint: a "
        "quantised .gguf in its blocks, a compressed-tensors or FP8 checkpoint in its scheme, else float. "
        "gguf: serve the blocks of smollm2 or a .gguf file; int8 and fp8: quantise a float checkpoint at load.",
    )
    _float(
        e,
        "--structured-outputs-compile-timeout",
        30.0,
        "A structured-output request whose grammar is not compiled within S seconds gets a 400.",
        metavar="S",
    )
    e.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Always run decode steps eagerly: do not capture CUDA graphs (engine/runner/cuda_graphs.py).",
    )
    e.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="The decode batch sizes captured as CUDA graphs; a decode step is padded to the next one. "
        "Default: 1 2 4 8 16 ... up to --max-num-seqs.",
    )


def _parallel_arguments(e: Group) -> None:
    e.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="The number of tensor parallel ranks the model is split over, one process each "
        "(engine/parallel; cuda:0 to cuda:N-1 on a GPU host).",
    )
    _float(
        e,
        "--distributed-timeout-seconds",
        30.0,
        "With more than one rank: a collective, or the group's set-up, that does not finish within S "
        "seconds fails the engine rather than hanging it.",
        metavar="S",
    )


def _lora_arguments(lora: Group) -> None:
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters loaded at start, each served under NAME (implies --enable-lora).",
    )
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters; more can be loaded at run time with POST /v1/load_lora_adapter.",
    )
    _int(
        lora,
        "--max-loras",
        1,
        "The maximum number of adapters resident on the device at once; an idle one is evicted "
        "(least recently used) to make room.",
    )
    _int(lora, "--max-lora-rank", 16, "The largest adapter rank accepted.")
    _int(
        lora,
        "--max-cpu-loras",
        None,
        "The maximum number of adapters kept in CPU memory. Default: --max-loras.",
    )


def _sim_arguments(s: Group) -> None:
    s.add_argument(
        "--simulate",
        action="store_true",
        help="Replace the model with a timing model: the real scheduler and KV accounting, no weights and "
        "no torch.",
    )
    s.add_argument(
        "--sim-gpu",
        default="h100",
        help="The GPU whose datasheet times the simulated steps (h100, a100, l4, ...).",
    )
    s.add_argument(
        "--sim-model",
        help="The model whose shape times the simulated steps. Default: --model, or llama-3-8b.",
    )
    _float(s, "--sim-speedup", 1.0, "Run the simulated clock this many times faster than real time.")
    _float(
        s,
        "--sim-base-ms",
        None,
        "The fixed cost of a simulated step in milliseconds. Default: the weights' bytes over the "
        "GPU's memory bandwidth.",
    )
    _float(
        s,
        "--sim-per-token-ms",
        None,
        "The cost of each batched token in milliseconds. Default: its compute on the GPU.",
    )
    _float(
        s,
        "--sim-lora-load-ms",
        50.0,
        "The simulated time, in milliseconds, to load an adapter that is not resident onto the device.",
    )
    _float(
        s,
        "--sim-per-context-token-us",
        None,
        "The cost of each token of context read, in microseconds. Default: its KV bytes over the "
        "GPU's memory bandwidth.",
    )


def _tool_arguments(t: Group) -> None:
    from kvfleet.engine.server.reasoning import REASONING_PARSERS
    from kvfleet.engine.server.tool_parsers import PARSERS

    t.add_argument(
        "--tool-call-parser", choices=sorted(PARSERS), default=None,
        help="How the model writes tool calls, which tool_choice 'auto' reads with it: hermes (also the "
        "prompt kvfleet renders for templates without tools), llama3_json, mistral, openai (gpt-oss) or qwen.",
    )  # fmt: skip
    t.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="How the model writes its reasoning, returned apart as message.reasoning_content: deepseek_r1, "
        "qwen3 (<think>...</think>; honours chat_template_kwargs.enable_thinking), openai_gptoss (Harmony).",
    )  # fmt: skip
    t.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="Serve tool_choice 'auto' (needs --tool-call-parser). 'required' and a named function always are.",
    )  # fmt: skip
