"""The engine's one validated configuration object (built from ``kvfleet engine`` flags or ``LLM(...)``).

Where it sits: read by the runner (model, dtype, device, KV memory, attention backend),
the KV cache manager (block size, prefix caching) and the scheduler (token budget,
batch size, policy). Invalid values fail here, naming the field and the limit.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.protocol import DEFAULT_BLOCK_SIZE


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        default="tiny", description="a Hugging Face checkpoint folder, a .gguf file, 'tiny' or 'smollm2'"
    )
    served_model_name: str | None = None  # default: model.sources.served_name (folder name, GGUF stem, tiny)
    # auto (engine/runner/dtype.py): the checkpoint's dtype against the device; on the CPU a 16-bit
    # checkpoint in bf16 where AMX-BF16 or AVX512-BF16 is there, else (and for float32 or quantized
    # checkpoints) float32; bf16 on a GPU
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    seed: int = 0
    max_model_len: int | None = Field(default=None, ge=1)  # None: the model's max_position_embeddings
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, le=256)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    kv_cache_memory: int | None = Field(default=None, ge=1)  # bytes; wins over gpu_memory_utilization
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    num_kv_blocks: int | None = Field(default=None, ge=1)  # exact block count (tests); wins over both
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # a registered policy name: "fcfs", "priority"
    # auto: "cpu" (native decode kernel) on a CPU where it builds, else "torch"
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    enable_chunked_prefill: bool = True
    # Stall-free batching (engine/sched/step_cost.py), on by default for a served engine (`kvfleet engine`
    # passes stall_free=True unless --no-stall-free; streams need it), off for offline LLM.generate, where
    # it cost throughput (SmolLM2, 48 prompts, quiet 2-core EPYC: 106 vs 150 out tok/s) and no one streams: while
    # streams are decoding, a step's prefill chunks are sized so the step's predicted time stays within
    # max(target_step_ms, stall_free_factor x the decode step midway from the running decodes to the batch
    # they make with the prompts running or waiting, or x the decodes' own if more; chunks fill it divided by the
    # 0.9 quantile of measured / predicted mixed steps, engine/sched/step_cost.py), so a step with
    # prefill is at most that factor times a decode step, whatever the batch (the ITL p99/p50 it
    # allows), and prefill keeps the rest (the throughput it keeps).
    # target_step_ms: a decode gap the deployment accepts anyway (its SLO, spec.slo.itlP99Ms through the
    # operator): prefill may fill a step up to it. stall_free False: steps bounded by
    # max_num_batched_tokens only (kvfleet before #33). Needs enable_chunked_prefill.
    stall_free: bool = False
    stall_free_factor: float = Field(default=2.0, gt=1.0)
    target_step_ms: float | None = Field(default=None, gt=0.0)
    # stall-free with a model: run the real step on synthetic batches at start (2-3 s for SmolLM2 on a
    # CPU, engine/core/step_profile.py), so the cost model knows prefill and decode costs before the first burst
    profile_step_cost: bool = True
    # float32 on the CPU: keep each layer's linears packed once for a GEMM library, for steps of more
    # than 16 rows (about one more copy of those weights in memory); False: torch packs them per call
    prepack_weights: bool = True
    # which library (kernels/packing/): auto, the faster on this machine (timed at load), mkl, onednn
    weight_packing: Literal["auto", "mkl", "onednn", "native"] = "auto"
    # LoRA (engine/lora): adapters by name → PEFT folder, loaded at start; more at run time if enabled.
    enable_lora: bool = False  # implied by lora_modules
    lora_modules: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(default=1, ge=1)  # adapters resident on the device (and in one step) at once
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int | None = Field(default=None, ge=1)  # adapters kept in CPU memory; None: max_loras
    # Tensor parallelism (engine/parallel): ranks, each a process holding its shard of the weights and
    # KV heads; every collective (gloo) and the group's set-up fail after this many seconds, never hang.
    tensor_parallel_size: int = Field(default=1, ge=1)
    distributed_timeout_seconds: float = Field(default=30.0, gt=0.0)
    # Structured outputs (engine/structured): a grammar not compiled in this many seconds is a 400.
    structured_outputs_compile_timeout: float = Field(default=30.0, gt=0.0)
    # vLLM's flags (engine/runner/cuda_graphs.py): enforce_eager runs decode steps without CUDA graphs;
    # cuda_graph_sizes are the decode batch sizes captured (None: 1, 2, 4, 8, 16, ... up to max_num_seqs);
    # given on the CPU, decode batches are padded to them there too (no graphs: a plain call)
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # vLLM's flag (engine/core/async_scheduling.py): schedule and launch step N+1 while step N's tokens are
    # still on the device (fed to N+1 there), and read them afterwards; False: one step at a time
    async_scheduling: bool = False
    # vLLM's flag, over what the checkpoint says (layers/linear/config.py, resolved once by the runner):
    # None infers it (a quantised GGUF --model in its blocks on the CPU, a compressed-tensors or fp8
    # checkpoint in its scheme, else float); gguf serves smollm2's or a .gguf's blocks; int8 (CPU) and
    # fp8 (GPU, cc >= 8.9) quantise a float checkpoint's linears at load (loader/hf_quant.py);
    # each takes LoRA adapters and tensor_parallel_size > 1 (every loader shards)
    quantization: Literal[None, "gguf", "int8", "fp8"] = None
    # vLLM's flags: "pooling" serves embeddings (POST /v1/embeddings) and nothing else: the engine core
    # pools the final hidden states of each prompt (engine/model/pooling.py), writes no KV cache and samples
    # nothing; override_pooler_config's pooling_type / normalize go over what the checkpoint says
    runner: Literal["generate", "pooling"] = "generate"
    override_pooler_config: dict[str, Any] | None = None

    @property
    def plans_stall_free(self) -> bool:
        """Whether the scheduler plans steps stall-free: asked for, with chunked prefill to size, and
        not static batching (a benchmark baseline that runs whole batches as they were admitted)."""
        stepped = self.runner == "generate"  # a pooling engine plans no steps (nor profiles them at start)
        return (
            stepped and self.stall_free and self.enable_chunked_prefill and self.scheduling_policy != "static"
        )

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @model_validator(mode="after")
    def _fields_agree(self) -> EngineConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if self.target_step_ms is not None and not (self.enable_chunked_prefill and self.stall_free):
            raise ValueError(
                "target_step_ms sizes prefill chunks: it needs enable_chunked_prefill and stall_free"
            )
        if self.runner == "pooling" and (self.tensor_parallel_size > 1 or self.lora_enabled):
            raise ValueError("runner='pooling' runs on one rank without LoRA adapters (yet)")
        return self
