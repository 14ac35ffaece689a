"""One offline contender of ``bench/peers/peers.py``, in a process of its own; prints one JSON line.

    python -m bench.peers.peers_offline --engine kvfleet|vllm|hf --model FOLDER --requests FILE [--batch-sizes 8,32]

``FILE`` is JSON: a list of ``{"prompt": [token ids], "max_tokens": n}``. Every request
generates exactly ``max_tokens`` tokens (greedy, EOS ignored). The engine is imported
only inside its branch and the ``LLM`` is built under ``if __name__ == "__main__"``, so the
script runs under vLLM's own venv (which has no kvfleet) as well as under kvfleet's.
Threads come from the environment (``OMP_NUM_THREADS``), set by the caller.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

Request = dict[str, Any]


def run_kvfleet(model: str, requests: list[Request]) -> list[dict[str, Any]]:
    from kvfleet.engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    llm.generate([requests[0]["prompt"]], params[:1])  # warm-up: first-call allocations, kernel build
    start = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in requests], params)
    seconds = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outs]
    return [row("kvfleet LLM.generate", seconds, requests, produced)]


def run_vllm(model: str, requests: list[Request], max_model_len: int) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    prompts: list[Any] = [{"prompt_token_ids": r["prompt"]} for r in requests]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outs]
    return [row("vLLM LLM.generate", seconds, requests, produced)]


def run_hf(model: str, requests: list[Request], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """transformers ``generate`` in left-padded static batches; each row runs to its batch's longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore EOS: every row generates max_new_tokens
    pad = 0

    def batch(rs: list[Request]) -> None:
        width = max(len(r["prompt"]) for r in rs)
        ids = torch.full((len(rs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rs), width), dtype=torch.long)
        for i, r in enumerate(rs):
            ids[i, width - len(r["prompt"]) :] = torch.tensor(r["prompt"])
            mask[i, width - len(r["prompt"]) :] = 1
        longest = max(r["max_tokens"] for r in rs)
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, pad_token_id=pad
            )
        assert out.shape[1] == width + longest

    batch(requests[:1])  # warm-up
    rows = []
    for b in batch_sizes:
        start = time.perf_counter()
        for i in range(0, len(requests), b):
            batch(requests[i : i + b])
        seconds = time.perf_counter() - start
        # only the requested tokens count: a padded row's extra tokens are static batching's waste
        rows.append(
            row(f"transformers generate, batch {b}", seconds, requests, [r["max_tokens"] for r in requests])
        )
    return rows


def row(name: str, seconds: float, requests: list[Request], produced: list[int]) -> dict[str, Any]:
    wanted = [r["max_tokens"] for r in requests]
    assert produced == wanted, f"{name}: every request must produce exactly its max_tokens"
    import torch

    return {
        "name": name,
        "seconds": seconds,
        "output_tokens": sum(wanted),
        "prompt_tokens": sum(len(r["prompt"]) for r in requests),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["kvfleet", "vllm", "hf"], required=True)
    p.add_argument("--model", required=True, help="a Hugging Face folder")
    p.add_argument("--requests", type=Path, required=True)
    p.add_argument("--batch-sizes", default="8,32", help="hf only: static batch sizes to try")
    p.add_argument("--max-model-len", type=int, default=1024, help="vllm only")
    args = p.parse_args()
    requests = json.loads(args.requests.read_text())
    if args.engine == "kvfleet":
        rows = run_kvfleet(args.model, requests)
    elif args.engine == "vllm":
        rows = run_vllm(args.model, requests, args.max_model_len)
    else:
        rows = run_hf(args.model, requests, [int(b) for b in args.batch_sizes.split(",")])
    print("PEERS_RESULT " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
