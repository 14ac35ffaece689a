"""The torch reference backend against dense causal attention on contiguous K/V."""

import torch

from kvfleet.engine.attention import AttentionBackend, LayerKV, get_backend

from .steps import step_metadata


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_len, k_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _stored_sequences(
    backend: AttentionBackend, layer: LayerKV, tables: torch.Tensor, lens: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random keys and values for each sequence, stored through ``backend`` at its block table's slots."""
    block_size, kv_heads, dim = layer.k_cache.shape[1:]
    ks = [torch.randn(n, kv_heads, dim) for n in lens]
    vs = [torch.randn(n, kv_heads, dim) for n in lens]
    for s, n in enumerate(lens):
        slots = torch.tensor(
            [int(tables[s, i // block_size]) * block_size + i % block_size for i in range(n)]
        )
        backend.store_kv(ks[s], vs[s], layer, slots)
    return ks, vs


def test_paged_reference_equals_dense_attention_for_a_prefill_and_a_decode_sequence() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 4, 2, 8, 4
    k_cache = torch.zeros(10, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    backend = get_backend("torch")
    # seq 0: 6 tokens, all new (prefill) in blocks [3, 7]; seq 1: 9 tokens, 1 new (decode) in [1, 2, 5]
    tables = torch.tensor([[3, 7, 0], [1, 2, 5]], dtype=torch.int32)
    lens, q_lens = [6, 9], [6, 1]
    ks, vs = _stored_sequences(backend, LayerKV(k_cache, v_cache, 1.0), tables, lens)
    q = torch.randn(sum(q_lens), heads, dim)
    meta = step_metadata(lens, q_lens, tables)
    out = backend.forward(q, LayerKV(k_cache, v_cache, dim**-0.5), meta)
    torch.testing.assert_close(out[:6], _dense_causal(q[:6], ks[0], vs[0], dim**-0.5))
    torch.testing.assert_close(out[6:], _dense_causal(q[6:], ks[1], vs[1], dim**-0.5))


def _dense_windowed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """Dense attention under transformers' own sliding-window causal mask function."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    allowed = sliding_window_causal_mask_function(window)
    q_len, k_len = q.shape[0], k.shape[0]
    zero = torch.tensor(0)
    mask = allowed(zero, zero, torch.arange(k_len - q_len, k_len)[:, None], torch.arange(k_len)[None, :])
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, dim=1))


def test_a_sliding_window_masks_exactly_as_transformers_mask_for_prefill_and_batched_decode() -> None:
    torch.manual_seed(1)
    heads, kv_heads, dim, block_size, window = 4, 2, 8, 4, 3
    k_cache, backend = torch.zeros(12, block_size, kv_heads, dim), get_backend("torch")
    v_cache = torch.zeros_like(k_cache)
    # a 6-token prefill and two decodes (9 and 7 tokens of context): the decodes run batched
    tables = torch.tensor([[3, 7, 0], [1, 2, 5], [8, 9, 0]], dtype=torch.int32)
    lens, q_lens = [6, 9, 7], [6, 1, 1]
    ks, vs = _stored_sequences(backend, LayerKV(k_cache, v_cache, 1.0), tables, lens)
    q = torch.randn(sum(q_lens), heads, dim)
    meta = step_metadata(lens, q_lens, tables)
    out = backend.forward(q, LayerKV(k_cache, v_cache, dim**-0.5, window), meta)
    rows = [slice(0, 6), slice(6, 7), slice(7, 8)]
    for s, r in enumerate(rows):
        torch.testing.assert_close(out[r], _dense_windowed(q[r], ks[s], vs[s], dim**-0.5, window))
    assert not torch.allclose(out[6:7], _dense_causal(q[6:7], ks[1], vs[1], dim**-0.5))
