"""Simulated mode (``kvfleet engine --simulate``): the real scheduler and KV accounting, a timing model for the model.

Where it sits: :class:`SimRunner` subclasses the ``Runner`` base class of
``engine/runner/base.py``; ``Engine`` drives it exactly as it drives the real model runner,
so batching, chunked prefill, prefix caching, preemption and ``/load`` behave as on a GPU.
Only ``execute`` differs: it sleeps for the step time the :class:`TimingModel` predicts
(divided by ``speedup``) and samples a fixed token sequence. Nothing here imports torch,
so many simulated engines fit on one small machine (the router's tests run eight).

Sampling is deterministic: the k-th output token of every sequence is the byte
``SIM_ALPHABET[k % 26]``, so ``max_tokens=5`` always yields ``"abcde"`` and never EOS.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet import capacity
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.outputs import SampleResult, TokenLogprob
from kvfleet.engine.runner.base import Runner
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer

SIM_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
DEFAULT_SIM_MODEL = "llama-3-8b"


class SimConfigError(ValueError):
    """A simulator parameter out of range; the message names the flag."""


@dataclass(frozen=True)
class TimingModel:
    """Seconds one engine step takes on the simulated GPU.

    step = base_s + per_token_s × batched tokens + per_context_token_s × Σ context lengths
           + per_row_s × sequences in the step.
    ``base_s`` is reading every weight once (weights ÷ bandwidth), ``per_token_s`` the compute
    of one token (2 × params ÷ FLOP/s: what makes prefill cost grow per prompt token), and
    ``per_context_token_s`` reading one token's K and V (kv bytes per token ÷ bandwidth: what
    makes decode cost grow with batch size and context). ``per_row_s`` is what each sequence costs
    beyond its tokens (its LM head row, sampling, attention set-up): 0 from the capacity maths; about
    1 ms for SmolLM2 on a 2-core CPU (``bench/serving/stall_free_sim.py``), where a decode row costs
    nearly twice a prefill token, which the stall-free scheduler's cost model sees too.
    """

    base_s: float
    per_token_s: float
    per_context_token_s: float
    per_row_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_context_token_s", "per_row_s"):
            if getattr(self, name) < 0:
                raise SimConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_seconds(self, plan: SchedulerPlan) -> float:
        if plan.is_empty:
            return 0.0
        context = sum(s.context_len for s in plan.scheduled)
        return (
            self.base_s
            + self.per_token_s * plan.num_batched_tokens
            + self.per_context_token_s * context
            + self.per_row_s * len(plan.scheduled)
        )

    @classmethod
    def for_hardware(
        cls, gpu: str, model: str, *, dtype: str = "bfloat16", compute_efficiency: float = 0.5
    ) -> TimingModel:
        """From the capacity maths of a named GPU and model (``h100``, ``llama-3-8b``)."""
        if not 0.0 < compute_efficiency <= 1.0:
            raise SimConfigError(f"sim_compute_efficiency must be in (0, 1], got {compute_efficiency}")
        spec, shape = capacity.resolve_gpu(gpu), capacity.resolve_model(model)
        return cls(
            base_s=capacity.weights_bytes(shape, dtype) / spec.bandwidth_bytes_per_s,
            per_token_s=2.0 * shape.active_params / (spec.bf16_flops * compute_efficiency),
            per_context_token_s=capacity.kv_bytes_per_token(shape, dtype) / spec.bandwidth_bytes_per_s,
        )


def kv_blocks_for_hardware(
    gpu: str,
    model: str,
    *,
    block_size: int,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory: int | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
) -> int:
    """KV blocks the simulated GPU holds: ``kv_cache_memory`` bytes if given, else what the capacity plan leaves."""
    shape = capacity.resolve_model(model)
    per_block = capacity.kv_bytes_per_token(shape, dtype) * block_size
    if kv_cache_memory is not None:
        kv_bytes = kv_cache_memory
    else:
        plan = capacity.plan_capacity(
            shape,
            capacity.resolve_gpu(gpu),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            context=min(shape.max_position_embeddings, 2048),
        )
        kv_bytes = plan.kv_bytes
    blocks = kv_bytes // per_block
    if blocks < 1:
        raise SimConfigError(
            f"{model} leaves no KV memory on {gpu} (kv bytes {kv_bytes} < one block of {per_block} bytes)"
        )
    return int(blocks)


def sim_token_id(output_index: int) -> int:
    return SIM_ALPHABET[output_index % len(SIM_ALPHABET)]


class SimRunner(Runner):
    """A ``Runner`` that sleeps for the timing model's step time and samples ``SIM_ALPHABET`` in turn."""

    def __init__(
        self,
        num_kv_blocks: int,
        timing: TimingModel,
        *,
        speedup: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if num_kv_blocks < 1:
            raise SimConfigError(f"num_kv_blocks must be at least 1, got {num_kv_blocks}")
        if speedup <= 0:
            raise SimConfigError(f"sim_speedup must be > 0, got {speedup}")
        self._num_kv_blocks = num_kv_blocks
        self.timing = timing
        self.speedup = speedup
        self._sleep = sleep
        self.simulated_seconds = 0.0  # total step time of the timing model, before the speedup
        # the last step's simulated seconds: the engine's step cost model learns this clock, not the
        # wall clock (which runs ``speedup`` times faster), so a step time target means simulated ms
        self.last_step_seconds = 0.0
        self.num_steps = 0

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    def execute(self, plan: SchedulerPlan) -> dict[int, SampleResult]:
        seconds = self.timing.step_seconds(plan)
        self.simulated_seconds += seconds
        self.last_step_seconds = seconds
        self.num_steps += 1
        if seconds > 0:
            self._sleep(seconds / self.speedup)
        return {
            s.seq.seq_id: _sample(s.seq.num_output_tokens, s.seq.params.logprobs)
            for s in plan.scheduled
            if s.sample
        }


def _sample(output_index: int, logprobs: int | None) -> SampleResult:
    token = sim_token_id(output_index)
    if logprobs is None:
        return SampleResult(token)
    # The sampled token is certain (logprob 0); the runners-up follow it in the alphabet.
    top = tuple((sim_token_id(output_index + j), -10.0 * j) for j in range(logprobs))
    return SampleResult(token, TokenLogprob(token, 0.0, top))


def timing_from_args(args: argparse.Namespace, model: str, dtype: str) -> TimingModel:
    """The capacity maths' timing for ``--sim-gpu``/``--sim-model``, with any explicit ``--sim-*`` cost overriding."""
    base = TimingModel.for_hardware(args.sim_gpu, model, dtype=dtype)
    return TimingModel(
        base_s=base.base_s if args.sim_base_ms is None else args.sim_base_ms / 1e3,
        per_token_s=base.per_token_s if args.sim_per_token_ms is None else args.sim_per_token_ms / 1e3,
        per_context_token_s=(
            base.per_context_token_s
            if args.sim_per_context_token_us is None
            else args.sim_per_context_token_us / 1e6
        ),
    )


def build_simulated(args: argparse.Namespace, flags_config: EngineConfig) -> Engine:
    """``kvfleet engine --simulate``: the real ``Engine`` over a :class:`SimRunner` and the byte tokenizer.

    ``flags_config`` is the config the flags describe (``cli.engine_config``); the simulated GPU
    sets its KV blocks and context length, and adapters stay in the API process.
    """
    model = args.sim_model or (args.model if args.model != "tiny" else DEFAULT_SIM_MODEL)
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    shape = capacity.resolve_model(model)
    blocks = args.num_kv_blocks or kv_blocks_for_hardware(
        args.sim_gpu,
        model,
        block_size=args.block_size,
        dtype=dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    max_model_len = args.max_model_len or shape.max_position_embeddings
    # Adapters of a simulated engine live in its API process (engine/sim_lora.py), not in the core.
    update: dict[str, object] = {
        "num_kv_blocks": blocks,
        "max_model_len": max_model_len,
        "lora_modules": {},
        "enable_lora": False,
    }
    config = flags_config.model_copy(update=update)
    runner = SimRunner(blocks, timing_from_args(args, model, dtype), speedup=args.sim_speedup)
    return Engine(config, runner=runner, tokenizer=ByteTokenizer())
