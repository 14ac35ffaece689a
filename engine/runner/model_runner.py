"""The model runner: one scheduler plan → one flat batch → the model → one token per sampling seq.

Where it sits: ``Engine.step()`` calls ``ModelRunner.execute(plan)`` (the ``Runner``
protocol of ``engine/runner/base.py``) after ``Scheduler.schedule()``. The runner owns the
model and the paged KV cache (one tensor per layer, shape (2, num_blocks, block_size,
kv_heads, head_dim), plus one null block at the end where the decode path runs,
``engine/runner/padded_steps.py``). Each step takes the route the step dispatcher picks
(``engine/runner/step_dispatch.py``: ``graph``, ``native`` or ``per_op``, logged at debug level): decode
steps padded to a size of the decode path run there, the others unpadded; every step's inputs are
written into the runner's one set of step buffers (``engine/runner/step_buffers.py``); the model runs
under ``torch.inference_mode`` and the runner samples.

:func:`build_runner` is the one entry point the Engine uses: it resolves the model name, loads
the model and the tokenizer and reports a :class:`ModelInfo`.

KV cache size, in order: ``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes;
else on CUDA what :func:`gpu_kv_budget` gives (``gpu_memory_utilization`` of the device's memory
minus what the weights and an activation reserve take, by ``kvfleet.capacity``'s one verdict, which
also refuses a model whose KV blocks would not hold one ``max_model_len`` sequence); else on the CPU :data:`CPU_DEFAULT_KV_BYTES` (512 MiB),
capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.

Tensor parallelism (``tensor_parallel_size`` > 1, ``engine/parallel/``): this runner is rank 0.
It starts the workers (:func:`~kvfleet.engine.parallel.leader.spawn_workers`) before loading its
own shard, so all ranks load at once; its KV cache holds its own KV heads, and the block count it
decides (rank 0 holds the most KV heads, the first ranks getting the extra ones) is every rank's.
Each step it sends the flat batch to the workers before its forward; it alone samples. On the CPU
each rank runs torch with its share of the threads. At tp=1 none of this runs. The quantization
config is resolved first, once, and handed to every worker: float, int8/fp8 and GGUF models shard
(``layers/linear``: each method cuts its own weights).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.capacity import check_engine_fits, model_shape_from_config
from kvfleet.engine.attention import get_backend
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.kernels.native.quant_gemm import cpu_paths_line
from kvfleet.engine.kv.groups import kv_layout
from kvfleet.engine.layers.linear.config import resolve_quantization
from kvfleet.engine.loader.gguf_loader import gguf_model
from kvfleet.engine.loader.hf_loader import load_config
from kvfleet.engine.loader.registry import load_for
from kvfleet.engine.loader.sources import resolve_model, served_name
from kvfleet.engine.lora.manager import LoraManager
from kvfleet.engine.model.batch import FlatBatch
from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.kv_tensors import layer_kv_caches
from kvfleet.engine.model.pooler_config import pooler_for
from kvfleet.engine.model.pooling import pool_to_bytes
from kvfleet.engine.model.rope_scaling import rope_is_dynamic
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.parallel.group import TPComm
from kvfleet.engine.parallel.leader import Leader, rank_device, spawn_workers
from kvfleet.engine.parallel.shard import RankShard, all_shards, lora_slices
from kvfleet.engine.runner.base import Runner
from kvfleet.engine.runner.dtype import pick_dtype
from kvfleet.engine.runner.launched_step import PickedStep
from kvfleet.engine.runner.padded_steps import DecodePath, DecodeSetup, decode_setup
from kvfleet.engine.runner.sampler import Sampler, SampleRequest
from kvfleet.engine.runner.step_buffers import StepBuffers
from kvfleet.engine.runner.step_dispatch import RunnerCaps, StepDispatcher, StepRoute
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.structured import StructuredOutputs
from kvfleet.engine.tokenizer.base import Tokenizer
from kvfleet.engine.tokenizer.hf import HFTokenizer

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    has_chat_template: bool
    # False when a block's KV depends on more than its tokens (dynamic rope: on the length of
    # the step that computed it), so a prefix-cache hit would not give transformers' result.
    prefix_caching_exact: bool = True
    kv_window: int | None = None  # every layer slides within it: the KV manager frees blocks before it
    kv_group_windows: tuple[int | None, ...] | None = None  # per KV cache group (engine/kv/groups.py)


def pick_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto``: the native ``cpu`` backend on a CPU where its kernel builds, ``triton`` on a GPU
    where Triton is installed, else ``torch``."""
    if name != "auto":
        return name
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is not None:
            return "triton"  # 6x the torch reference's per-sequence loop on SmolLM2 (H200)
        log.warning("attention backend auto: torch, not triton (Triton is not installed)")
    elif device.type == "cpu":
        from kvfleet.engine.kernels.native.paged_decode import load_kernel

        build = load_kernel()
        if build.kernel is not None:
            return "cpu"
        log.warning("attention backend auto: torch, not cpu (%s)", build.reason)
    return "torch"


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_model_len
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ModelLoadError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} "
            f"(max_position_embeddings in config.json, as far as its rope_scaling stretches it)"
        )
    return config.max_model_len


def gpu_kv_budget(
    config: EngineConfig, model_path: Path, dtype: torch.dtype, max_model_len: int, *, used: int, total: int
) -> int:
    """This rank's KV cache bytes on a GPU of ``total`` bytes with ``used`` taken (weights loaded), as
    :func:`kvfleet.capacity.check_engine_fits` gives them: the operator's CapacityFits asks the same
    function (with the used bytes predicted), so the two never disagree on what fits. A model that
    does not fit is a :class:`ModelLoadError` with the verdict's reason."""
    try:
        shape = model_shape_from_config(json.loads((model_path / "config.json").read_text()), model_path.name)
        verdict = check_engine_fits(
            shape,
            str(dtype).removeprefix("torch."),
            config.tensor_parallel_size,
            total,
            config.gpu_memory_utilization,
            max_model_len,
            config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            used_bytes=used,
        )
    except (OSError, ValueError) as e:  # CapacityError is a ValueError
        raise ModelLoadError(f"{model_path}: cannot size the KV cache ({e})") from e
    if not verdict.fits:
        raise ModelLoadError(f"{model_path} does not fit: {verdict.reason}")
    return verdict.kv_cache_bytes_per_rank


class ModelRunner(Runner):
    """Implements ``Runner``: owns the model, the KV cache and the sampler."""

    def __init__(self, config: EngineConfig, model_path: Path | str) -> None:
        self.config = config
        self.model_path = Path(model_path)
        self.device = pick_device(config)
        choice = pick_dtype(config, self.device, self.model_path)
        self.dtype, backend = choice.dtype, resolve_backend(config.attention_backend, self.device)
        log.info("%s", choice.line())  # the start-up line: which ISA path, which dtype, and why
        if self.device.type == "cpu":
            log.info("%s", cpu_paths_line())
            bf16 = probe_cpu_paths().bf16
            if self.dtype == torch.bfloat16 and bf16.path == "none":  # honoured, as vLLM-CPU does
                log.warning("dtype bfloat16 kept as asked (half the weights' memory), but %s", bf16.note)
        # once, before any worker starts or weight is read: what the checkpoint is, --quantization over it
        gguf = gguf_model(config.model, config.quantization)
        self.quantization = resolve_quantization(
            config.quantization, self.model_path, self.device, self.dtype, gguf
        )
        self.quantization.check_serves(self.device, self.dtype)
        self.dtype = self.quantization.compute_dtype(self.dtype)  # bf16 weights, float32 compute: bf16.py
        self.shard: RankShard | None = None
        self.leader: Leader | None = None
        if config.tensor_parallel_size > 1:
            self.leader = self._start_workers(backend)
        self.model = load_for(
            self.quantization, config.model, self.model_path, self.dtype, self.device, self.shard
        )
        prepack = config.prepack_weights and self.quantization.prepacks
        self.weight_packing = self.model.prepack(config.weight_packing) if prepack else None
        self.model_config = self.model.config
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.pooler = pooler_for(config, self.model_path)  # --runner pooling: embeddings only, one KV block
        self.backend = get_backend(backend)
        self.block_size = config.block_size
        self.decode: DecodePath | None = None
        self.kv_layout = kv_layout(self.model_config.layer_windows, self.model_config.num_layers)
        setup = decode_setup(config, self.device, backend, self.model_config, self.max_model_len)
        if self.kv_layout.hybrid:  # several block tables: the per-op path only
            setup = None
        self._allocate(None if self.pooler else setup)  # a pooling runner never decodes: no CUDA graphs
        self.sampler = Sampler(config.seed, self.device)
        self._last: PickedStep | None = None  # the last launched step: the next one may feed on it
        self.dispatcher = StepDispatcher(RunnerCaps())  # its capabilities read at the first step
        self._caps_key: tuple[object, ...] | None = None
        self.structured: StructuredOutputs | None = None  # set by the Engine: masks constrained rows
        self.lora: LoraManager | None = None
        if config.lora_enabled and self.model_config.moe is not None:
            raise ModelLoadError(
                f"LoRA adapters (enable_lora, lora_modules) are not supported on a mixture-of-experts "
                f"model ({self.model_config.architecture})"
            )
        if config.lora_enabled:
            slices = None if self.shard is None else lora_slices(self.shard, self.model_config.head_dim)
            self.lora = LoraManager.for_engine(config, self.model_config, self.device, self.dtype, slices)
        if self.leader is not None:
            if self.lora is not None:
                self.lora.mirror = self.leader.mirror_lora
            self.leader.start(self._num_blocks)  # every worker loaded and allocated: ready to step
            self.model.comm = self.leader.comm

    def _allocate(self, setup: DecodeSetup | None) -> None:
        """The KV cache (sized after the graphs' memory is measured), the one set of step buffers
        every step and route fills, and the decode path that pads its steps in them (if any)."""
        kv_heads = self.model_config.num_kv_heads if self.shard is None else self.shard.kv_heads.size
        shape = (2, 1, self.block_size, kv_heads, self.model_config.head_dim)
        self._graph_bytes = 0 if setup is None else setup.measure(self.model, self.backend, shape)
        self._num_blocks = self._count_kv_blocks()
        null_blocks = 0 if setup is None else 1  # the decode path's padding rows write the last block
        shape = (2, self._num_blocks + null_blocks, *shape[2:])
        self.kv_caches = layer_kv_caches(self.kv_layout, shape, self.dtype, self.device)
        seqs, tokens = self.config.max_num_seqs, self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill:  # a step's one prompt may pass the budget, whole
            tokens = max(tokens, self.max_model_len)
        if setup is None:
            width = -(-self.max_model_len // self.block_size) + 1
            self.inputs = StepBuffers(seqs, width, self.block_size, 0, self.device, tokens)
        else:
            self.inputs = setup.buffers(self._num_blocks, seqs, tokens)
            self.decode = setup.build(self.model, self.kv_caches, self.backend, self.inputs)

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def _start_workers(self, backend: str) -> Leader:
        """Rank 0's shard, and ranks 1..tp-1 started (a ModelLoadError names what cannot be split)."""
        tp = self.config.tensor_parallel_size
        shards = all_shards(load_config(self.model_path), tp)
        self.shard = shards[0]
        self.device = rank_device(self.device, 0)
        threads = max(1, torch.get_num_threads() // tp)
        if self.device.type == "cpu":
            torch.set_num_threads(threads)  # the ranks share the machine's cores
        return spawn_workers(
            self.config, self.quantization, str(self.model_path), self.device, self.dtype, backend, shards,
            threads,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the tensor-parallel workers (none at tp=1)."""
        if self.leader is not None:
            self.leader.close()

    @property
    def tp_comm(self) -> TPComm | None:
        return None if self.leader is None else self.leader.comm

    def _count_kv_blocks(self) -> int:
        layout = self.kv_layout  # a block id's page holds layout.num_tensors layers' KV
        block_bytes = self.block_size * self.model_config.kv_bytes_per_token(self.dtype)
        block_bytes = block_bytes * layout.num_tensors // self.model_config.num_layers
        if self.shard is not None:  # this rank's KV heads only
            block_bytes = block_bytes * self.shard.kv_heads.size // self.model_config.num_kv_heads
        if self.config.num_kv_blocks is not None or self.pooler is not None:
            return self.config.num_kv_blocks or 1
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            needed = (
                self.config.max_num_seqs
                * len(layout.groups)  # a sequence's blocks in each group
                * (self.max_model_len + self.block_size)
                * (block_bytes // self.block_size)
            )
            budget = min(CPU_DEFAULT_KV_BYTES, needed)
        blocks = budget // block_bytes
        if blocks < 1:
            raise ModelLoadError(
                f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes "
                f"(block_size={self.block_size}); raise kv_cache_memory or gpu_memory_utilization"
            )
        return int(blocks)

    def _cuda_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return gpu_kv_budget(
            self.config, self.model_path, self.dtype, self.max_model_len,
            used=total - free + self._graph_bytes, total=total,
        )  # fmt: skip

    def pool(self, prompts: list[list[int]], dimensions: int | None) -> list[bytes]:
        if self.pooler is None:
            return super().pool(prompts, dimensions)
        return pool_to_bytes(self.model, prompts, self.pooler, dimensions)

    def execute(self, plan: SchedulerPlan) -> dict[int, SampleResult]:
        return {} if plan.is_empty else self.launch(plan).read()

    def launch(self, plan: SchedulerPlan) -> PickedStep:
        """Run the plan on the route the step dispatcher picks and pick its tokens on the device
        without reading them (async scheduling); placeholder inputs take the previous launched
        step's tokens there."""
        fed, self._last = self._last, None
        route = self.route(plan)
        native = route.path == "native"
        if route.padded:  # a decode step padded to a size of the static buffers (runner/padded_steps.py)
            assert self.decode is not None
            with torch.inference_mode():
                return self._pick(plan, *self.decode.run(plan, route.rows, native, fed))
        with torch.inference_mode():
            batch = self.inputs.fill_plan(plan, fed)
        slots: dict[str, int] | None = None
        if self.lora is not None and any(s.seq.lora_name is not None for s in plan.scheduled):
            adapters = [s.seq.lora_name for s in plan.scheduled for _ in range(s.num_new_tokens)]
            ctx = self.lora.context(adapters)
            slots = self.lora.slots_of({n for n in adapters if n is not None})
            batch = dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, lora=ctx))
        if self.leader is not None:  # the workers run the same forward: their collectives meet ours
            lora = batch.meta.lora
            self.leader.send_step(batch, slots, None if lora is None else lora.token_slots)
        with torch.inference_mode():
            return self._pick(plan, self._forward(batch, native), batch.sample_seq_ids)

    def route(self, plan: SchedulerPlan) -> StepRoute:
        """The plan's route, over capabilities refreshed when what they read changed (the decode path
        dropped, the weights repacked, the native step turned off)."""
        fused = self.model.fused_decode()
        key = (self.decode, fused)
        if self._caps_key is None or any(a is not b for a, b in zip(key, self._caps_key, strict=True)):
            self._caps_key = key
            native = None if fused is None or self.kv_layout.hybrid else fused.native_step(self.backend)
            no_native = self._no_native(fused is None)
            caps = RunnerCaps(native=native, no_native=no_native)
            self.dispatcher.caps = caps if self.decode is None else self.decode.caps(native, no_native)
        return self.dispatcher.pick(plan)

    def _no_native(self, unbuilt: bool) -> str:
        """Why the runner offers no native one-call step (read only where it offers none)."""
        if self.model.comm is not None:
            return "tensor parallelism: the native call holds no all-reduce"
        if not self.model.use_fused_decode:
            return "the native call is turned off"
        layer = self.model.no_native_layer()
        if layer is not None:
            return layer
        if self.kv_layout.hybrid:
            return "several KV cache groups (sliding and full layers): the native call reads one block table"
        if unbuilt:
            return f"these weights ({self.dtype}, {self.device.type}) do not fit the native call"
        return f"the {type(self.backend).__name__} runs no native call"

    def _pick(self, plan: SchedulerPlan, logits: torch.Tensor, seq_ids: tuple[int, ...]) -> PickedStep:
        """One token per sampling row of ``logits`` (in the order of ``seq_ids``), picked on the device."""
        if self.structured is not None and seq_ids:  # after whichever forward (per-op or fused) made them
            self.structured.mask(logits, seq_ids)
        requests = sample_requests(plan)
        tokens = self.sampler.pick(logits, requests)
        self._last = PickedStep(self.sampler, tokens, logits, requests, seq_ids)
        return self._last

    def _forward(self, batch: FlatBatch, native: bool) -> torch.Tensor:
        return self.model(
            batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend, batch.sample_rows,
            native=native,
        )  # fmt: skip


def sample_requests(plan: SchedulerPlan) -> list[SampleRequest] | None:
    """The sampler's view of the plan's sampling rows; None when every row is plain greedy."""
    seqs = [s.seq for s in plan.scheduled if s.num_computed_before + s.num_new_tokens == s.seq.num_tokens]
    if all(seq.params.plain_greedy for seq in seqs):
        return None
    return [
        SampleRequest(s.params, s.index, s.num_output_tokens, s.prompt_token_ids, s.output_token_ids)
        for s in seqs
    ]


def build_runner(config: EngineConfig) -> tuple[ModelRunner, Tokenizer, ModelInfo]:
    """What the Engine calls: the runner, the tokenizer and what the server needs to know."""
    path = resolve_model(config.model)
    runner = ModelRunner(config, path)
    tokenizer = HFTokenizer(path)
    model_config = runner.model_config
    name = config.served_model_name or served_name(config.model)
    info = ModelInfo(
        name=name,
        max_model_len=runner.max_model_len,
        eos_token_ids=tokenizer.eos_token_ids | model_config.eos_token_ids,
        vocab_size=model_config.vocab_size,
        has_chat_template=tokenizer.chat_template is not None,
        prefix_caching_exact=not rope_is_dynamic(model_config),
        kv_window=model_config.kv_window,
        kv_group_windows=runner.kv_layout.windows,
    )
    return runner, tokenizer, info
