"""A GGUF model over two ranks, with and without a LoRA adapter: the GGUF loader cuts each rank's part
as the float loader does (q/k/v, gate/up and the vocabulary by whole rows of blocks, o_proj/down_proj
by input columns at block boundaries), and the adapters' shards add their deltas to whatever kernel
ran each matmul.

Each rank's partial sums are the single rank's up to float summation order
(tests/engine/layers/test_tp_over_methods.py), but the next matmul quantises its activations to int8
per 32, so a last-bit difference can move one int8 rounding: the greedy tokens are compared
(a divergence only on a near-tie, ``compare.py``) and each chosen token's logprob within
LOGPROB_TOL, not bit for bit. The same blocks served against their dequantised float32 weights
differ by as much (0.02 nats on the tiny model's first prompt)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from safetensors.numpy import load_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.kernels.native.quant_gemm import QuantWeight, load_quant
from kvfleet.engine.layers.linear.gguf_blocks import GgufMethod, QuantEmbedding
from kvfleet.engine.loader.gguf_loader import RankCut
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.parallel.shard import rank_shard
from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.engine.testing.tiny_gguf import write_gguf

from ..lora.conftest import make_adapter
from .compare import assert_same_greedy
from .workers import assert_workers_ran, first_token_agreement

LOGPROB_TOL = 0.05  # nats: int8 activation roundings moved by float summation order (module docstring)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, *range(40, 69)], [256, 200, 17, 90, 33]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]

pytestmark = pytest.mark.skipif(load_quant() is None, reason="the native library does not build here")


def write_q8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool = False) -> Path:
    """The tiny model as a Q8_0 GGUF; ``tied``: without ``output.weight`` (the head reads the embedding)."""
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))  # the conversion's cache
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    if tied:
        del weights["lm_head.weight"]
    name = "tiny-tied-Q8_0.gguf" if tied else "tiny-Q8_0.gguf"
    return write_gguf(tmp_path / name, weights, qtype=gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture
def q8_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return write_q8(tmp_path, monkeypatch)


def serve(model: Path, tp: int, lora: str | None = None, **kw: object) -> list[RequestOutput]:
    llm = LLM(str(model), tensor_parallel_size=tp, num_kv_blocks=64, **kw)  # type: ignore[arg-type]
    try:
        runner = llm.engine.runner
        assert runner.quantization.method == "gguf"  # in its blocks on every rank, not dequantised
        embed = runner.model.model.embed_tokens
        assert isinstance(embed, QuantEmbedding) and embed.num_embeddings == (259 if tp == 1 else 130)
        outs = llm.generate(PROMPTS, GREEDY, lora=lora) if lora else llm.generate(PROMPTS, GREEDY)
        assert_workers_ran(llm, tp)
        return outs
    finally:
        llm.close()


def assert_logprobs_close(one: list[RequestOutput], two: list[RequestOutput]) -> float:
    """Each chosen token's logprob at tp=2 within LOGPROB_TOL of tp=1's; the largest gap."""
    gaps = []
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            gaps.append(abs(la.top[0][1] - lb.top[0][1]))
    assert max(gaps) <= LOGPROB_TOL, f"logprobs {max(gaps):.3g} apart, over {LOGPROB_TOL}"
    return max(gaps)


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_model_over_two_ranks_keeps_the_single_ranks_greedy_tokens(
    tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_q8(tmp_path, monkeypatch, tied)  # a tied head reads its rank's embedding rows
    one, two = serve(path, 1), serve(path, 2)  # detected from the file: no --quantization
    assert_same_greedy(one, two, f"gguf {path.name} tp=2")
    gap = assert_logprobs_close(one, two)
    print(f"\n{path.name} tp=2 against tp=1: chosen logprobs at most {gap:.2e} apart")


def test_an_adapter_over_gguf_blocks_on_two_ranks_keeps_the_single_ranks_tokens(
    q8_gguf: Path, tmp_path: Path
) -> None:
    adapter = make_adapter(ensure_tiny_model(), tmp_path / "adapter", 4, 8, False, TARGETS, seed=1)
    kw = {"quantization": "gguf", "lora_modules": {"a": str(adapter)}}
    one, two = serve(q8_gguf, 1, "a", **kw), serve(q8_gguf, 2, "a", **kw)
    assert_same_greedy(one, two, "gguf + LoRA tp=2")
    assert_logprobs_close(one, two)
    base = serve(q8_gguf, 2, None, **kw)
    tokens = [list(o.outputs[0].token_ids) for o in two]
    assert tokens != [list(o.outputs[0].token_ids) for o in base], "the adapter changes the tokens"


def test_a_rank_boundary_inside_a_gguf_block_is_refused_naming_the_tensor() -> None:
    # intermediate 96 over two ranks: down_proj's columns 0:48 and 48:96 cut its second block of 32
    config = SimpleNamespace(
        num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=64, moe=None
    )
    down = np.random.default_rng(0).standard_normal((32, 96)).astype(np.float32)
    blocks = QuantWeight(torch.from_numpy(quantize(down, gguf.GGMLQuantizationType.Q8_0)), 8, 96)
    cut = RankCut(GgufMethod(), config, rank_shard(config, 2, 0), "llama")  # type: ignore[arg-type]
    with pytest.raises(
        ModelLoadError,
        match=r"blk\.0\.ffn_down\.weight cannot be split over tensor_parallel_size=2: rank 0's "
        r"columns 0:48 cut its blocks of 32 \(GGUF type Q8_0\)",
    ):
        cut.weight("blk.0.ffn_down.weight", blocks)
    up = QuantWeight(blocks.blocks[:, :0].new_zeros(96, 34), 8, 32)  # (96 out, 32 in): rows cut whole
    assert cut.weight("blk.0.ffn_up.weight", up).out_features == 48


@pytest.mark.slow
def test_smollm2s_q4_1_blocks_over_two_ranks_keep_the_first_greedy_token_of_most_prompts() -> None:
    """SmolLM2-135M's Q4_1 file at tp=2 (o_proj cut at column 384, down_proj at 768: block
    boundaries; uneven heads). Each matmul's shards are the single rank's (row-parallel sums within
    4e-7 relative, measured on every layer), but 30 layers carry one moved int8 rounding into
    differences as large as the blocks' own error against their dequantised floats (on three chat
    prompts: first-token logprobs 0.02-0.08 nats apart at tp=2, 0.02-0.05 between blocks and floats,
    which choose another first token on one of the three), so, as int8 against float32
    (tests/engine/parallel/test_tp_quantized.py), the share of prompts whose first greedy token
    agrees is asserted and printed (96% measured)."""
    prompts = [
        torch.randint(3, 49152, (3 + i % 8,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(48)
    ]

    def make(tp: int) -> LLM:
        return LLM("smollm2", quantization="gguf", tensor_parallel_size=tp, num_kv_blocks=64)

    def blocks_embedding(llm: LLM) -> None:
        assert isinstance(llm.engine.runner.model.model.embed_tokens, QuantEmbedding)

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    share = first_token_agreement(make, prompts, greedy, blocks_embedding)
    print(f"\nsmollm2 Q4_1 tp=2 against tp=1: first greedy token agrees on {share:.0%}")
    assert share >= 0.8
