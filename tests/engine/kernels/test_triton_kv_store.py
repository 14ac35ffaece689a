"""The Triton KV store kernel against the torch reference (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.attention.torch_backend import store_kv_reference
from kvfleet.engine.kernels.triton.kv_store import store_kv


def _caches(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
):  # type: ignore[no-untyped-def]
    # one preallocated (2, ...) tensor per layer, as the runner allocates it; NaN marks "never written"
    kv = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    return kv[0], kv[1]


@pytest.mark.parametrize(
    ("num_tokens", "kv_heads", "head_dim", "block_size"),
    [(37, 2, 64, 16), (5, 1, 128, 8), (16, 8, 64, 32), (23, 2, 80, 16)],
)
def test_new_tokens_land_in_their_slots_and_no_other_slot_changes(
    device: torch.device, num_tokens: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks = 6
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, head_dim, torch.float32, device)
    k_ref, v_ref = _caches(num_blocks, block_size, kv_heads, head_dim, torch.float32, device)
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_reference(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)
    assert int(k_cache.isnan().any(-1).any(-1).sum()) == num_blocks * block_size - num_tokens


def test_fp32_keys_are_rounded_to_an_fp16_cache_like_torch_does(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(12, 2, 64, generator=gen).to(device)
    slots = torch.arange(3, 15, device=device)
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float16, device)
    store_kv(k, -k, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(32, 2, 64)[3:15], k.half())
    assert torch.equal(v_cache.view(32, 2, 64)[3:15], (-k).half())


def test_fp32_keys_land_in_a_bf16_cache_within_one_bf16_step(device: torch.device) -> None:
    # a GPU rounds to nearest like torch (test_gpu_kernels asserts equality); the interpreter truncates
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(12, 2, 64, generator=gen).to(device)
    slots = torch.arange(3, 15, device=device)
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.bfloat16, device)
    store_kv(k, k, k_cache, v_cache, slots)
    stored = k_cache.view(32, 2, 64)[3:15].float()
    assert bool(((stored - k).abs() <= k.abs() * 2.0**-7).all())
    assert torch.equal(v_cache.view(32, 2, 64)[3:15], k_cache.view(32, 2, 64)[3:15])


def test_keys_and_values_read_as_strided_views_of_a_fused_qkv_projection(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, 4 + 2 + 2, 64, generator=gen).to(device)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([31, 0, 7, 8, 15, 16, 17, 30, 2], device=device)
    k_cache, v_cache = _caches(4, 8, 2, 64, torch.float32, device)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(32, 2, 64)[slots], k)
    assert torch.equal(v_cache.view(32, 2, 64)[slots], v)


def test_slots_outside_the_cache_are_skipped_and_the_others_written(device: torch.device) -> None:
    k = torch.arange(4 * 64, dtype=torch.float32, device=device).view(4, 1, 64)
    slots = torch.tensor([-1, 5, 32, 31], device=device)  # the cache holds slots 0..31
    k_cache, v_cache = _caches(2, 16, 1, 64, torch.float32, device)
    store_kv(k, k + 1, k_cache, v_cache, slots)
    flat = k_cache.view(32, 64)
    assert torch.equal(flat[5], k[1, 0]) and torch.equal(flat[31], k[3, 0])
    assert int(flat.isnan().all(-1).sum()) == 30
