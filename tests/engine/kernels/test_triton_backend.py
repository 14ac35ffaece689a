"""The ``triton`` backend behind the attention interface: same answers as ``torch``, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata, LayerKV, get_backend
from kvfleet.engine.attention.triton_backend import TritonAttentionBackend
from kvfleet.engine.kernels.triton import paged_attention


def test_get_backend_builds_the_triton_backend_by_name() -> None:
    backend = get_backend("triton")
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"


def test_a_layer_step_through_the_interface_matches_the_torch_backend(
    paged_batch: Callable, device: torch.device
) -> None:
    batch = paged_batch(
        [(21, 4), (9, 9), (30, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, device=device
    )
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(14, 2, 64, generator=gen).to(device)
    v = torch.randn(14, 2, 64, generator=gen).to(device)
    # the step's own tokens: the last query_len positions of each sequence
    tables, lens, starts = (
        batch.meta.block_tables.cpu(),
        batch.meta.seq_lens.tolist(),
        batch.meta.query_start_loc.tolist(),
    )
    positions = [p for s in range(3) for p in range(lens[s] - (starts[s + 1] - starts[s]), lens[s])]
    owners = [s for s in range(3) for _ in range(starts[s + 1] - starts[s])]
    slots = torch.tensor(
        [int(tables[s, p // 8]) * 8 + p % 8 for s, p in zip(owners, positions, strict=True)]
    ).to(device)
    meta = replace(batch.meta, slot_mapping=slots)
    outs = []
    for name in ("triton", "torch"):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        backend = get_backend(name)
        backend.store_kv(k, v, LayerKV(k_cache, v_cache, 1.0), meta.slot_mapping)
        outs.append((backend.forward(batch.q, LayerKV(k_cache, v_cache, 0.125), meta), k_cache))
    torch.testing.assert_close(outs[0][1], outs[1][1], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("q_shape", "cache_shape", "message"),
    [
        ((3, 4, 512), (4, 8, 2, 512), "head_dim 512 exceeds the triton backend's limit 256"),
        ((3, 3, 64), (4, 8, 2, 64), "num_heads 3 is not a multiple of num_kv_heads 2"),
        ((3, 4, 32), (4, 8, 2, 64), r"q must be \(T, num_heads, 64\), got \(3, 4, 32\)"),
    ],
)
def test_forward_rejects_shapes_the_kernel_cannot_serve(
    device: torch.device, q_shape: tuple[int, ...], cache_shape: tuple[int, ...], message: str
) -> None:
    cache = torch.zeros(cache_shape, device=device)
    meta = _one_decode_meta(device)
    with pytest.raises(ValueError, match=message):
        get_backend("triton").forward(
            torch.zeros(q_shape, device=device), LayerKV(cache, cache.clone(), 1.0), meta
        )


def test_forward_rejects_query_offsets_that_do_not_cover_every_sequence(device: torch.device) -> None:
    cache = torch.zeros(4, 8, 2, 64, device=device)
    meta = replace(
        _one_decode_meta(device), query_start_loc=torch.tensor([0], dtype=torch.int32, device=device)
    )
    with pytest.raises(ValueError, match=r"query_start_loc must be \(2,\) for 1 sequences, got \(1,\)"):
        get_backend("triton").forward(
            torch.zeros(1, 2, 64, device=device), LayerKV(cache, cache.clone(), 1.0), meta
        )


def test_forward_rejects_a_block_table_without_a_row_per_sequence(device: torch.device) -> None:
    cache = torch.zeros(4, 8, 2, 64, device=device)
    meta = replace(_one_decode_meta(device), block_tables=torch.zeros(2, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"block_tables must be \(1, max_blocks_per_seq\), got \(2, 3\)"):
        get_backend("triton").forward(
            torch.zeros(1, 2, 64, device=device), LayerKV(cache, cache.clone(), 1.0), meta
        )


def test_forward_rejects_a_sliding_window_of_no_keys(device: torch.device) -> None:
    cache = torch.zeros(4, 8, 2, 64, device=device)
    with pytest.raises(ValueError, match="sliding_window must be at least 1 token, got 0"):
        get_backend("triton").forward(
            torch.zeros(1, 2, 64, device=device),
            LayerKV(cache, cache.clone(), 1.0, 0),
            _one_decode_meta(device),
        )


def test_a_rejected_store_leaves_the_cache_as_it_was(device: torch.device) -> None:
    k_cache, v_cache = torch.zeros(2, 4, 2, 64, device=device), torch.zeros(2, 4, 2, 64, device=device)
    k = torch.ones(3, 2, 64, device=device)
    with pytest.raises(ValueError, match=r"slot_mapping must be \(3,\), got \(2,\)"):
        get_backend("triton").store_kv(
            k, k, LayerKV(k_cache, v_cache, 1.0), torch.tensor([0, 1], device=device)
        )
    with pytest.raises(ValueError, match=r"v_cache must match k_cache in shape and strides"):
        get_backend("triton").store_kv(
            k, k, LayerKV(k_cache, v_cache[:1], 1.0), torch.tensor([0, 1, 2], device=device)
        )
    assert not k_cache.any() and not v_cache.any()


def _one_decode_meta(device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([0], device=device),
        block_tables=torch.tensor([[1]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
    )


def test_cpu_tensors_without_the_interpreter_get_an_error_that_says_how_to_enable_it() -> None:
    code = (
        "import torch\n"
        "from kvfleet.engine.attention import LayerKV, get_backend\n"
        "z = torch.zeros(1, 1, 8)\n"
        "get_backend('triton').store_kv(z, z, LayerKV(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), 1.0), torch.tensor([0]))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "triton attention on cpu tensors needs TRITON_INTERPRET=1 in the environment" in done.stderr


def test_kernels_run_interpreted_exactly_when_there_is_no_cuda_device() -> None:
    assert paged_attention.INTERPRETED is (not torch.cuda.is_available())
