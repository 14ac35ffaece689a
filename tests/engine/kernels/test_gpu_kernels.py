"""The Triton kernels compiled on a GPU at real model shapes (Llama-3-8B: 32 heads, 8 kv heads,
head_dim 128, block 16, bf16), against the torch reference. Skipped without CUDA."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kvfleet.engine.attention.torch_backend import paged_attention_reference, store_kv_reference
from kvfleet.engine.kernels.triton.kv_store import store_kv

from .conftest import heads, run_triton, shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LLAMA3_8B = heads(32, 8, 128, 16)


def _mixed_batch_of_32(max_len: int = 4096, seed: int = 0) -> list[tuple[int, int]]:
    # 8 whole prefills, 8 chunked prefills (a 256-token chunk after a long context), 16 decodes
    rng = random.Random(seed)
    prefills = [(n, n) for n in (rng.randint(1, 1024) for _ in range(8))]
    chunks = [(n, 256) for n in (rng.randint(257, max_len) for _ in range(8))]
    decodes = [(rng.randint(1, max_len), 1) for _ in range(15)] + [(max_len, 1)]
    mixed = prefills + chunks + decodes
    rng.shuffle(mixed)
    return mixed


def _assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype == torch.bfloat16
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2e-2)


def test_llama3_8b_mixed_batch_of_32_up_to_4k_tokens_matches_the_reference(paged_batch: Callable) -> None:
    batch = paged_batch(
        _mixed_batch_of_32(), dtype=torch.bfloat16, device="cuda", strided_q=True, **LLAMA3_8B
    )
    _assert_close_bf16(
        run_triton(batch, 128**-0.5),
        paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 128**-0.5),
    )


def test_mistral_7b_shaped_mixed_batch_with_a_1k_sliding_window_matches_the_reference(
    paged_batch: Callable,
) -> None:
    batch = paged_batch(_mixed_batch_of_32(seed=2), dtype=torch.bfloat16, device="cuda", **LLAMA3_8B)
    _assert_close_bf16(
        run_triton(batch, 128**-0.5, 1000),
        paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 128**-0.5, 1000),
    )


def test_llama3_8b_decode_batch_of_128_matches_the_reference(paged_batch: Callable) -> None:
    rng = random.Random(1)
    seqs = [(rng.randint(1, 4096), 1) for _ in range(128)]
    batch = paged_batch(seqs, dtype=torch.bfloat16, device="cuda", **LLAMA3_8B)
    _assert_close_bf16(
        run_triton(batch, 128**-0.5),
        paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 128**-0.5),
    )


@pytest.mark.parametrize("shape", shapes((32, 8, 64, 8), (28, 4, 128, 32), (16, 16, 256, 16), (8, 2, 96, 16)))
def test_other_tile_configurations_compile_and_match_the_reference(
    paged_batch: Callable, shape: dict[str, int]
) -> None:
    seqs = [(700, 700), (2000, 64), (1500, 1), (17, 1), (33, 33)]
    batch = paged_batch(seqs, **shape, dtype=torch.bfloat16, device="cuda")
    scale = shape["head_dim"] ** -0.5
    _assert_close_bf16(
        run_triton(batch, scale),
        paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale),
    )


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
def test_llama3_8b_store_of_a_4k_token_step_equals_the_reference_exactly(source_dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, tokens = 2048, 4096
    k = torch.randn(tokens, 8, 128, device="cuda", generator=gen).to(source_dtype)
    v = torch.randn(tokens, 8, 128, device="cuda", generator=gen).to(source_dtype)
    slots = torch.randperm(num_blocks * 16, device="cuda", generator=gen)[:tokens]
    caches = [torch.zeros(2, num_blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    store_kv(k, v, caches[0][0], caches[0][1], slots)
    store_kv_reference(k, v, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1])
