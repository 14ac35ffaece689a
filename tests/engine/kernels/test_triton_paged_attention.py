"""The Triton paged-attention kernel against the torch reference (interpreter on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfleet.engine.attention.torch_backend import paged_attention_reference
from kvfleet.engine.kernels.triton.paged_attention import choose_tiles, paged_attention

from .conftest import MHA_GQA2_GQA4, heads, run_triton, shapes

# (seq_len, query_len): a whole prefill, a chunked prefill across a block boundary, decodes
MIXED = [(19, 19), (41, 9), (33, 1), (1, 1), (16, 1)]


def _reference(batch, scale: float, window: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)


@pytest.mark.parametrize(
    "shape",
    shapes(
        *MHA_GQA2_GQA4,
        (8, 1, 128, 16),  # GQA 8
        (4, 1, 80, 8),  # GQA 4, head_dim not a power of two
        (2, 1, 96, 32),  # GQA 2, head_dim not a power of two
        (7, 1, 64, 16),  # GQA 7 (Qwen2-7B's ratio), group not a power of two
    ),
)
def test_mixed_prefill_chunked_prefill_and_decode_batch_matches_the_reference(
    paged_batch: Callable, device: torch.device, shape: dict[str, int]
) -> None:
    batch = paged_batch(MIXED, **shape, device=device)
    scale = shape["head_dim"] ** -0.5
    out = run_triton(batch, scale)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, _reference(batch, scale), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("seqs", "shape", "window"),
    [
        (MIXED, heads(4, 2, 64, 8), 1),  # each row sees only itself
        (MIXED, heads(8, 2, 64, 16), 5),  # a window inside one block
        (MIXED, heads(7, 1, 80, 16), 16),  # window = block size; group and head_dim not powers of two
        (
            [(155, 5), (120, 40), (70, 1)],
            heads(4, 2, 64, 16),
            40,
        ),  # key tiles wholly before the window skipped
        ([(33, 1), (16, 1), (70, 1), (5, 1)], heads(8, 2, 64, 8), 9),  # decode-only tiles
    ],
)
def test_a_sliding_window_batch_matches_the_windowed_reference(
    paged_batch: Callable,
    device: torch.device,
    seqs: list[tuple[int, int]],
    shape: dict[str, int],
    window: int,
) -> None:
    batch = paged_batch(seqs, **shape, device=device)
    scale = shape["head_dim"] ** -0.5
    expected = _reference(batch, scale, window)
    assert not torch.allclose(expected, _reference(batch, scale))  # the window masks keys here
    out = run_triton(batch, scale, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_window_wider_than_every_sequence_is_plain_causal_attention(
    paged_batch: Callable, device: torch.device
) -> None:
    batch = paged_batch(MIXED, **heads(4, 2, 64, 16), device=device)
    torch.testing.assert_close(run_triton(batch, 0.125, 41), _reference(batch, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_keys_in_tiles_wholly_before_the_window_are_never_read(
    paged_batch: Callable, device: torch.device
) -> None:
    # a decode at position 154 with a window of 40 sees keys 115..154; its 64-key tiles start at 64
    batch = paged_batch([(155, 1)], **heads(4, 2, 64, 16), device=device)
    expected = _reference(batch, 0.125, 40)
    table = batch.meta.block_tables[0].tolist()
    for pos in range(64):  # poison them: a read would turn the output NaN (0 * NaN in p @ v)
        batch.k_cache[table[pos // 16], pos % 16] = float("nan")
        batch.v_cache[table[pos // 16], pos % 16] = float("nan")
    torch.testing.assert_close(run_triton(batch, 0.125, 40), expected, atol=2e-5, rtol=2e-5)
    assert run_triton(batch, 0.125).isnan().all()  # without the window they are read


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_only_batch_uses_one_token_tiles_and_matches_the_reference(
    paged_batch: Callable, device: torch.device, block_size: int
) -> None:
    # context lengths on, just past and just before block boundaries, and a 1-token sequence
    seqs = [(block_size, 1), (block_size + 1, 1), (2 * block_size - 1, 1), (1, 1), (70, 1)]
    batch = paged_batch(seqs, **heads(8, 2, 64, block_size), device=device)
    assert choose_tiles(group=4, head_dim=64, max_query_len=1).block_q == 4
    torch.testing.assert_close(run_triton(batch, 0.125), _reference(batch, 0.125), atol=2e-5, rtol=2e-5)


def test_long_context_chunk_attends_over_many_key_tiles(paged_batch: Callable, device: torch.device) -> None:
    # 150 tokens of context before a 5-token chunk: five key tiles, the causal edge in the last
    batch = paged_batch([(155, 5), (3, 2)], **heads(4, 2, 64, 16), device=device)
    torch.testing.assert_close(run_triton(batch, 0.2), _reference(batch, 0.2), atol=2e-5, rtol=2e-5)


def test_queries_read_as_a_strided_view_of_a_fused_qkv_projection(
    paged_batch: Callable, device: torch.device
) -> None:
    batch = paged_batch([(20, 20), (9, 1)], **heads(4, 2, 64, 8), device=device, strided_q=True)
    assert not batch.q.is_contiguous()
    torch.testing.assert_close(run_triton(batch, 0.125), _reference(batch, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_caches_match_the_fp32_reference_within_rounding(
    paged_batch: Callable, device: torch.device, dtype: torch.dtype, tol: float
) -> None:
    batch = paged_batch([(24, 24), (40, 7), (17, 1)], **heads(8, 2, 64, 16), dtype=dtype, device=device)
    out = run_triton(batch, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(batch, 0.125).float(), atol=tol, rtol=tol)


def test_an_empty_step_returns_an_empty_output(paged_batch: Callable, device: torch.device) -> None:
    batch = paged_batch([(4, 1)], **heads(2, 1, 64, 16), device=device)
    empty = batch.q[:0]
    meta = batch.meta
    out = paged_attention(
        empty,
        batch.k_cache,
        batch.v_cache,
        meta.block_tables[:0],
        meta.seq_lens[:0],
        meta.query_start_loc[:1],
        0,
        1.0,
    )
    assert out.shape == (0, 2, 64)
