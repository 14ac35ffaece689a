"""Embeddings per second of kvfleet's pooling forward against transformers, at batch 1 and 64, in one run.

    python -m bench.serving.embeddings [--model smollm2] [--threads 2] [--reps 5] [--publish]

Where it sits: what the engine core does for one ``EmbedCmd`` batch (``--runner pooling``:
``ModelRunner.pool``, ``engine/model/pooling.py``: the flat batch of prompts through the decoder
with no KV cache, last-token pooling, L2 norm, the vectors as float32 bytes) against transformers
as sentence-transformers runs a decoder: ``AutoModel`` over the prompts right-padded into one
batch with an attention mask, the last real token's final hidden state, L2 norm. Same float32
weights, same prompts (random token ids, 8 to 24 tokens each, fixed seed; short, so that the
run fits a shared 2-core box in under three minutes), same thread count.
Batch 1 is timed as 8 one-prompt calls per repeat, batch 64 as one call; the repeats interleave
the two contenders (a shared box's load lands on both), and each figure is the median of
``--reps`` with its min and max, per wall second and per CPU second of this process (the CPU time
moves less with the neighbours' load than the wall time does). The largest difference between the two sets of vectors is
printed with them. No HTTP: the server's share of a request is the same for either.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import Flag, bench_args, cpu_name, publish, resolve_model

SINGLE_CALLS = 8  # one-prompt calls per repeat at batch 1


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(8, 25))).tolist() for _ in range(n)]


def _kvfleet(path: str) -> tuple[Callable[[list[list[int]]], np.ndarray], int]:
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.runner.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=path, runner="pooling", device="cpu"), path)

    def embed(prompts: list[list[int]]) -> np.ndarray:
        return np.stack([np.frombuffer(v, dtype="<f4") for v in runner.pool(prompts, None)])

    return embed, runner.model_config.vocab_size


def _transformers(path: str) -> Callable[[list[list[int]]], np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(prompts: list[list[int]]) -> np.ndarray:
        longest = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), longest), dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(prompts)), mask.sum(dim=1) - 1]
        return F.normalize(last, dim=-1).numpy()

    return embed


def _rate(
    embed: Callable[[list[list[int]]], np.ndarray], prompts: list[list[int]], batch: int
) -> tuple[float, float]:
    """Embeddings per wall second and per CPU second (this process, every thread) of one repeat."""
    calls = [prompts[i : i + 1] for i in range(SINGLE_CALLS)] if batch == 1 else [prompts[:batch]]
    wall, cpu = time.perf_counter(), time.process_time()
    for call in calls:
        embed(call)
    n = sum(len(c) for c in calls)
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def main() -> None:
    args = bench_args(
        __doc__,
        model="smollm2",
        threads=Flag(2, "torch threads for both contenders"),
        reps=Flag(5, "repeats per (contender, batch): median, min, max"),
        publish=Flag(False, "also write bench/results/embeddings.txt"),
    )
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    kvfleet, vocab = _kvfleet(path)
    contenders = {"kvfleet": kvfleet, "transformers": _transformers(path)}
    prompts = _prompts(64, vocab, seed=46)
    diff = float(np.abs(kvfleet(prompts) - contenders["transformers"](prompts)).max())  # also the warm-up
    lines = [
        f"embeddings/s, {args.model} float32, prompts of 8-24 tokens, last-token pooling, L2 norm; "
        f"{cpu_name()}, {args.threads} threads, load average {os.getloadavg()[0]:.2f} at start; "
        f"median of {args.reps} (min-max); largest |kvfleet - transformers| over 64 vectors: {diff:.2e}"
    ]
    for batch in (1, 64):
        rates: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        for _ in range(args.reps):
            for name, embed in contenders.items():
                rates[name].append(_rate(embed, prompts, batch))
        for name, r in rates.items():
            wall, cpu = [w for w, _ in r], [c for _, c in r]
            lines.append(
                f"  batch {batch:>2}  {name:<12} {statistics.median(wall):7.1f} /s wall ({min(wall):.1f}-{max(wall):.1f})"
                f"  {statistics.median(cpu):7.1f} /CPU-s ({min(cpu):.1f}-{max(cpu):.1f})"
            )
    lines.append(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.publish:
        publish(lines, "embeddings.txt")
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
