"""Decode speed of the ``triton`` attention backend on a lent GPU, against the ``torch`` reference.

Where it sits: a benchmark (not a test) for a session that is lent a GPU (an H200 here).
It prints figures and writes them to ``$OUT/gpu_decode.txt`` (or ``bench/results/``):

1. correctness at Llama-3-8B shapes in bf16 (32 heads, 8 kv heads, head_dim 128, block 16):
   a mixed batch of 32 sequences up to 4k tokens, triton vs the torch reference, and the
   KV store kernel vs torch indexing;
2. the device's copy bandwidth, measured with one large ``torch`` copy (read + write);
3. decode tokens/s and model bandwidth utilisation (MBU = bytes read per step ÷ step time ÷
   measured copy bandwidth; bytes = all weights + every sequence's K/V) for randomly
   initialised Llama-3.2-1B- and Llama-3-8B-shaped models at batch 1, 32 and 128, with the
   triton backend and with the torch reference as the baseline of the same run.

Step 3 runs the engine's own model (``kvfleet.engine.model.llama``: the forward that
``ModelRunner.execute`` calls, with random weights built on the device, since a runner loads
a checkpoint folder and writing 16 GB of random safetensors would eat the GPU loan; the
runner's batch flattening and sampling are left out) when it is installed; otherwise a
stand-in, labelled as such in the output: per layer the q/k/v, output and SwiGLU projections as dense matmuls around the
same store_kv + attention calls, then the lm_head (no norms, no RoPE, no sampling).

Run on the GPU machine:  .venv/bin/python -m bench.gpu.gpu_decode
Smoke-run on a CPU:      TRITON_INTERPRET=1 .venv/bin/python -m bench.gpu.gpu_decode --smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.capacity import KNOWN_MODELS, ModelShape, kv_bytes_per_token, weights_bytes
from kvfleet.engine.attention import AttentionBackend, AttentionMetadata, LayerKV, get_backend
from kvfleet.engine.attention.torch_backend import paged_attention_reference, store_kv_reference

BLOCK_SIZE = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after ``warmup`` (compiles the kernels)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_metadata(batch: int, context: int, device: torch.device) -> AttentionMetadata:
    """One decode step: every sequence has ``context`` cached tokens and adds one."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    slots = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=context + 1,
    )


def mixed_metadata(seqs: list[tuple[int, int]], device: torch.device) -> AttentionMetadata:
    """(seq_len, query_len) per sequence, blocks laid out one sequence after another."""
    blocks = [-(-n // BLOCK_SIZE) for n, _ in seqs]
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    first = 0
    for s, count in enumerate(blocks):
        tables[s, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(n for n, _ in seqs),
    )


def check_correctness(settings: Settings, lines: list[str]) -> None:
    device, dtype, max_len, quarter = (
        settings.device,
        settings.dtype,
        settings.check_len,
        settings.check_seqs // 4,
    )
    rng = random.Random(0)  # a quarter whole prefills, a quarter 256-token chunks, half decodes
    seqs = [(n, n) for n in (rng.randint(1, max_len // 4) for _ in range(quarter))]
    seqs += [(n, min(n - 1, 256)) for n in (rng.randint(2, max_len) for _ in range(quarter))]
    seqs += [(rng.randint(1, max_len), 1) for _ in range(2 * quarter)]
    meta = mixed_metadata(seqs, device)
    num_blocks = int(meta.block_tables.max()) + 1
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, 8, 128, device=device, generator=gen).to(dtype)
    q = torch.randn(int(meta.query_start_loc[-1]), 32, 128, device=device, generator=gen).to(dtype)
    out = get_backend("triton").forward(q, LayerKV(cache[0], cache[1], 128**-0.5), meta)
    ref = paged_attention_reference(q, cache[0], cache[1], meta, 128**-0.5)
    err = (out.float() - ref.float()).abs()
    lines.append(
        f"attention, Llama-3-8B shapes, {dtype}, {len(seqs)} mixed seqs up to {max_len} tokens "
        f"({int(q.shape[0])} query tokens): max |triton - torch| = {err.max().item():.3e}, "
        f"mean = {err.mean().item():.3e}, mean |torch| = {ref.float().abs().mean().item():.3e}"
    )
    tokens = min(4096, num_blocks * BLOCK_SIZE)
    k = torch.randn(tokens, 8, 128, device=device, generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device, generator=gen)[:tokens]
    mine, theirs = cache.clone(), cache.clone()
    get_backend("triton").store_kv(k, -k, LayerKV(mine[0], mine[1], 1.0), slots)
    store_kv_reference(k, -k, theirs[0], theirs[1], slots)
    lines.append(
        f"store_kv, {tokens} fp32 tokens into a {dtype} cache: identical to torch = {torch.equal(mine, theirs)}"
    )


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of one large device copy, counting the read and the write."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, warmup=2, repeat=10)
    return 2 * num_bytes / seconds


@dataclass(frozen=True)
class Decoder:
    """One decode step of a model at a batch size, with a backend; ``kind`` says what runs."""

    kind: str
    step: Callable[[AttentionBackend], object]


def hf_config(shape: ModelShape) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie_word_embeddings,
    }


def kv_caches(
    shape: ModelShape, meta: AttentionMetadata, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    num_blocks = int(meta.block_tables.max()) + 1
    dims = (2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    return [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    """The engine's own Llama model with random weights, or None where it is not installed."""
    try:
        from kvfleet.engine.model.config import ModelConfig
        from kvfleet.engine.model.llama import LlamaForCausalLM
    except ImportError:
        return None
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(ModelConfig.from_dict(hf_config(shape)))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def model_decoder(
    model: torch.nn.Module, shape: ModelShape, batch: int, context: int, device: torch.device
) -> Decoder:
    meta = decode_metadata(batch, context, device)
    dtype = next(model.parameters()).dtype
    caches = kv_caches(shape, meta, device, dtype)
    ids = torch.randint(shape.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)

    def step(backend: AttentionBackend) -> object:
        with torch.inference_mode():
            return model(ids, positions, caches, meta, backend, rows)

    return Decoder("engine model forward (kvfleet.engine.model.llama)", step)


@dataclass(frozen=True)
class StandInWeights:
    embed: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # qkv, o, gate_up, down
    lm_head: torch.Tensor


def stand_in_weights(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> StandInWeights:
    h, d, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d

    def w(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, device=device, dtype=dtype) * dims[0] ** -0.5

    embed = w(shape.vocab_size, h)
    layers = [
        (w(h, qkv), w(shape.num_heads * d, h), w(h, 2 * inter), w(inter, h)) for _ in range(shape.num_layers)
    ]
    return StandInWeights(embed, layers, embed if shape.tie_word_embeddings else w(shape.vocab_size, h))


def stand_in_decoder(
    weights: StandInWeights, shape: ModelShape, batch: int, context: int, device: torch.device
) -> Decoder:
    meta = decode_metadata(batch, context, device)
    caches = kv_caches(shape, meta, device, weights.embed.dtype)
    ids = torch.randint(shape.vocab_size, (batch,), device=device)
    heads, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim

    def step(backend: AttentionBackend) -> object:
        x = weights.embed[ids]
        for (w_qkv, w_o, w_gate_up, w_down), cache in zip(weights.layers, caches, strict=True):
            qkv = (x @ w_qkv).view(batch, heads + 2 * kv, d)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv], qkv[:, heads + kv :]
            backend.store_kv(k, v, LayerKV(cache[0], cache[1], 1.0), meta.slot_mapping)
            x = (
                x
                + backend.forward(q, LayerKV(cache[0], cache[1], d**-0.5), meta).reshape(batch, heads * d)
                @ w_o
            )
            gate, up = (x @ w_gate_up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w_down
        return x @ weights.lm_head.T

    return Decoder("STAND-IN: attention + dense matmuls (engine model not installed)", step)


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype
    models: list[ModelShape]
    batches: list[int]
    context: int
    copy_bytes: int
    check_len: int
    check_seqs: int
    repeat: int


SMOKE_SHAPE = ModelShape("smoke", 2, 128, 4, 2, 32, 256, 512, False, 4096)


def settings_from_args(argv: list[str]) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence at each step")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else bench/results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results")
    if args.smoke:
        return Settings(torch.device("cpu"), torch.float32, [SMOKE_SHAPE], [1, 2], 40, 1 << 20, 48, 4, 1), out
    if not torch.cuda.is_available():
        parser.error("no CUDA device: run on a lent GPU, or pass --smoke")
    models = [KNOWN_MODELS[name] for name in args.models.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    return Settings(
        torch.device("cuda"), torch.bfloat16, models, batches, args.context, 4 << 30, 4096, 32, args.repeat
    ), out


def measure(settings: Settings, bandwidth: float, lines: list[str]) -> None:
    lines.append(
        f"{'model':<14}{'batch':>6}{'backend':>8}{'step ms':>10}{'tokens/s':>11}{'MBU':>7}{'vs torch':>9}  path"
    )
    for shape in settings.models:
        model = build_model(shape, settings.device, settings.dtype)
        weights = None if model is not None else stand_in_weights(shape, settings.device, settings.dtype)
        for batch in settings.batches:
            if model is not None:
                decoder = model_decoder(model, shape, batch, settings.context, settings.device)
            else:
                assert weights is not None
                decoder = stand_in_decoder(weights, shape, batch, settings.context, settings.device)
            step_bytes = weights_bytes(shape) + batch * (settings.context + 1) * kv_bytes_per_token(shape)
            seconds = {}
            for name, repeat in (("triton", settings.repeat), ("torch", max(settings.repeat // 3, 1))):
                backend = get_backend(name)
                seconds[name] = timed(lambda b=backend, d=decoder: d.step(b), settings.device, 2, repeat)
            for name, t in seconds.items():
                lines.append(
                    f"{shape.name:<14}{batch:>6}{name:>8}{t * 1e3:>10.2f}{batch / t:>11.1f}"
                    f"{step_bytes / t / bandwidth:>7.1%}{seconds['torch'] / t:>8.2f}x  {decoder.kind}"
                )
            print("\n".join(lines[-2:]), flush=True)
        del model, weights
        if settings.device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    settings, out = settings_from_args(argv)
    name = (
        torch.cuda.get_device_name(settings.device) if settings.device.type == "cuda" else "cpu (smoke run)"
    )
    lines = [
        f"device: {name}; dtype {settings.dtype}; block size {BLOCK_SIZE}; context {settings.context} tokens"
    ]
    check_correctness(settings, lines)
    bandwidth = copy_bandwidth(settings.device, settings.copy_bytes)
    lines.append(
        f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s ({settings.copy_bytes >> 20} MiB copy, read + write)"
    )
    print("\n".join(lines), flush=True)
    lines.append("MBU = (weights + batch x (context + 1) x KV bytes per token) / step time / copy bandwidth")
    measure(settings, bandwidth, lines)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("gpu_decode_smoke.txt" if settings.device.type == "cpu" else "gpu_decode.txt")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
