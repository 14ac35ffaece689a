"""Tensor parallelism wraps the linear methods: each method cuts its own weights
(``LinearMethod.shard``), and the quantized loader serves an int8 model over two ranks.

Column-parallel shards (q/k/v, gate/up, the LM head's vocabulary rows) give the single rank's
output columns bit for bit in every format. Row-parallel shards (o_proj, down_proj) are summed
across ranks: GGUF blocks cut at block boundaries keep the activations' blocks of 32 whole, so the
sum is the single rank's up to float summation order; int8 quantises each rank's slice of a token's
activations with its own scale (as vLLM's per-token dynamic quantisation does on each rank), so the
sum is the single rank's within int8's error (the engine over two ranks: tests/engine/parallel/
test_tp_quantized.py)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from kvfleet.engine.kernels.native.int8_gemm import load_int8
from kvfleet.engine.kernels.native.quant_gemm import QuantWeight, load_quant
from kvfleet.engine.layers.linear import get_method
from kvfleet.engine.model.errors import ModelLoadError

K, N = 128, 48
X = torch.randn(5, K, generator=torch.Generator().manual_seed(0))
W = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.1
B = torch.randn(N, generator=torch.Generator().manual_seed(2))
need_native = pytest.mark.skipif(
    load_int8() is None or load_quant() is None, reason="the native library does not build here"
)


def stored(name: str) -> object:
    method = get_method(name)
    if name == "gguf":
        return QuantWeight(torch.from_numpy(quantize(W.numpy(), Q.Q8_0)), int(Q.Q8_0), K)
    return method.quantize(W) if name in ("int8", "fp8") else W  # type: ignore[attr-defined]


@need_native
@pytest.mark.parametrize("name", ["float", "int8", "gguf", "fp8"])
def test_a_column_parallel_shard_gives_the_single_ranks_columns_bit_for_bit(name: str) -> None:
    method, w = get_method(name), stored(name)
    full = method.load([w], B)(X)
    for span in (slice(0, 16), slice(16, N)):
        part = method.load([method.shard(w, 0, span)], B[span])(X)
        assert torch.equal(part, full[:, span]), span


@need_native
@pytest.mark.parametrize(("name", "rtol"), [("float", 1e-5), ("gguf", 1e-5), ("fp8", 1e-5), ("int8", 2e-2)])
def test_row_parallel_shards_sum_to_the_single_rank(name: str, rtol: float) -> None:
    method, w = get_method(name), stored(name)
    full = method.load([w], B)(X)
    halves = [
        method.load([method.shard(w, 1, s)], B if s.start == 0 else None)(X[:, s])
        for s in (slice(0, 64), slice(64, K))
    ]
    total = halves[0] + halves[1]
    assert float((total - full).norm() / full.norm()) < rtol


def test_gguf_blocks_are_not_cut_across_a_block() -> None:
    w = stored("gguf")
    with pytest.raises(ModelLoadError, match="columns 0:48 cut its blocks of 32"):
        get_method("gguf").shard(w, 1, slice(0, 48))
