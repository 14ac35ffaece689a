"""SmolLM2-135M-Instruct on a lent GPU: the engine's greedy tokens against transformers, then speed.

Where it sits: a benchmark (not a test) for a session that is lent a GPU; the second stage of
``bench/gpu/gpu_checks.sh`` (issue #11's GPU part). It writes ``gpu_smollm2.txt`` under ``--out``.

1. correctness, float32: the engine (``triton`` and ``torch`` attention backends, on the GPU)
   against transformers loading the same GGUF itself in float32 on the GPU: greedy tokens of a
   mixed batch of chat prompts under a 32-token prefill budget (chunked prefill), then a prompt
   that hits the prefix cache. Any difference is printed and makes the exit status 1.
2. bfloat16: the engine against transformers, both in bf16. Rounding differs between the two
   (bf16 is not associative), so this prints how many of the tokens agree before the first
   difference; it does not fail on a difference.
3. offline speed, bf16: ``LLM.generate`` on random-token prompts (64-512 tokens, 32-128 output
   tokens, EOS ignored) against transformers ``generate`` in static batches, the baseline of
   the same run, as output tokens/s and the ratio.

Smoke-run on a CPU (checks the script runs):  .venv/bin/python -m bench.gpu.gpu_smollm2 --smoke
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvfleet.bench import LoadSpec, parse_distribution
from kvfleet.bench.load import plan_requests
from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader.sources import resolve_model, smollm2_gguf
from kvfleet.engine.tokenizer.hf import HFTokenizer

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CHATS = [
    [SYSTEM, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count to five."}],
    [SYSTEM, {"role": "user", "content": "Write one short sentence about the sea and the harbour at dawn."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
PREFIX_HIT = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Say = Callable[[str], None]


def hf_model(gguf: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(device).eval()
    )
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: Any, prompt: list[int], new_tokens: int, device: str) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=2,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def agreed(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def engine(backend: str, dtype: str, device: str, kv_bytes: int, **extra: Any) -> LLM:
    return LLM(
        model="smollm2",
        device=device,
        dtype=dtype,
        attention_backend=backend,
        kv_cache_memory=kv_bytes,
        **extra,
    )


def correctness(args: argparse.Namespace, gguf: Path, tok: HFTokenizer, say: Say) -> bool:
    prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in [*CHATS, PREFIX_HIT]]
    ok = True
    for dtype in args.dtypes:
        hf = hf_model(gguf, DTYPES[dtype], args.device)
        want = [hf_greedy(hf, p, args.new_tokens, args.device) for p in prompts]
        del hf
        for backend in args.backends:
            try:
                ok = compare(args, backend, dtype, prompts, want, say) and ok
            except Exception:  # noqa: BLE001 - one failed backend must not hide the others' results
                say(f"{dtype} {backend}: {traceback.format_exc()}")
                ok = False
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return ok


def compare(
    args: argparse.Namespace,
    backend: str,
    dtype: str,
    prompts: list[list[int]],
    want: list[list[int]],
    say: Say,
) -> bool:
    """The engine's greedy tokens against ``want``; False on a float32 difference (bf16: reported only)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm = engine(backend, dtype, args.device, args.kv_bytes, max_num_batched_tokens=32)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:-1], params)]
    hit = llm.generate(prompts[-1:], params)[0]
    got.append(hit.outputs[0].token_ids)
    same = [agreed(g, w) for g, w in zip(got, want, strict=True)]
    exact = all(s == args.new_tokens for s in same)
    say(
        f"{dtype:9s} {backend:7s} {len(prompts)} chats, {args.new_tokens} greedy tokens each, 32-token "
        f"prefill budget, prefix-cache hit {hit.num_cached_tokens} tokens: leading tokens equal to "
        f"transformers {same} -> {'IDENTICAL' if exact else 'DIFFERENT'}"
    )
    for g, w in zip(got, want, strict=True):
        if g != w:
            say(f"    engine       {g}\n    transformers {w}")
    return exact or dtype != "float32"  # bf16: reported, not failed


def offline_requests(args: argparse.Namespace) -> list[Any]:
    """The offline workload: random-token prompts of ``--input-len`` and outputs of ``--output-len``."""
    spec = LoadSpec(
        url="",
        num_requests=args.num_prompts,
        input_len=parse_distribution(args.input_len),
        output_len=parse_distribution(args.output_len),
    )
    return plan_requests(spec, random.Random(0))


def speed(args: argparse.Namespace, gguf: Path, say: Say) -> None:
    requests = offline_requests(args)
    outputs = sum(r.max_tokens for r in requests)
    prompts_tokens = sum(len(r.prompt) for r in requests)
    say(f"offline: {len(requests)} prompts ({prompts_tokens} tokens), {outputs} output tokens, EOS ignored")
    dtype = args.speed_dtype
    llm = engine("auto", dtype, args.device, args.kv_bytes)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt], params[:1])  # warm-up: kernels compile
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params)
    sync(args.device)
    base_s = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.max_tokens for r in requests]
    backend = llm.engine.runner.backend.name
    say(
        f"  kvfleet LLM.generate ({dtype}, attention {backend}): {base_s:.2f} s, {outputs / base_s:.0f} output tok/s"
    )
    del llm, outs
    gc.collect()
    hf = hf_model(gguf, DTYPES[dtype], args.device)
    for b in args.hf_batches:
        start = time.perf_counter()
        for i in range(0, len(requests), b):
            hf_batch(hf, requests[i : i + b], args.device)
        sync(args.device)
        s = time.perf_counter() - start
        say(
            f"  transformers generate ({dtype}), static batch {b}: {s:.2f} s, {outputs / s:.0f} output tok/s; "
            f"kvfleet = {s / base_s:.2f}x"
        )


def hf_batch(hf: Any, rs: list[Any], device: str) -> None:
    from bench.serving.offline_throughput import left_padded

    ids, mask = left_padded([r.prompt for r in rs], 0)
    longest = max(r.max_tokens for r in rs)
    with torch.inference_mode():
        hf.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=longest,
            pad_token_id=0,
        )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the script runs")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", default="uniform:64:512")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--hf-batches", default="32,128")
    p.add_argument("--backends", default="triton,torch", help="attention backends of the correctness part")
    p.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the correctness part")
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.backends, args.dtypes, args.speed_dtype = (
        args.backends.split(","),
        args.dtypes.split(","),
        "bfloat16",
    )
    args.kv_bytes = 4 << 30
    if args.smoke:
        args.new_tokens, args.num_prompts, args.output_len, args.input_len = (
            4,
            4,
            "uniform:4:8",
            "uniform:16:32",
        )
        args.backends, args.dtypes, args.speed_dtype, args.hf_batches = ["torch"], ["float32"], "float32", "4"
        args.kv_bytes = 64 << 20
    args.hf_batches = [int(b) for b in str(args.hf_batches).split(",")]
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / ("gpu_smollm2_smoke.txt" if args.smoke else "gpu_smollm2.txt")
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        out.write_text("\n".join(lines) + "\n")

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)"
    say(f"device: {name}; torch {torch.__version__}")
    start = time.perf_counter()
    folder = resolve_model("smollm2")
    gguf = smollm2_gguf()
    say(f"model: {gguf.name} -> {folder} ({time.perf_counter() - start:.1f} s to resolve)")
    tok = HFTokenizer(folder)
    ok = True
    for part in (lambda: correctness(args, gguf, tok, say), lambda: speed(args, gguf, say)):
        try:
            ok = part() is not False and ok
        except Exception:  # noqa: BLE001 - one failed part must not hide the next one's figures
            say(traceback.format_exc())
            ok = False
    say(f"{'PASS' if ok else 'FAIL'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
