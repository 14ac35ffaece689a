"""Attention sinks (gpt-oss): a learned logit per head in the softmax, in every attention backend.

The torch reference is checked against transformers' own gpt-oss attention (``eager_attention_forward``
of ``modeling_gpt_oss``); the batched torch path and the native CPU kernels (decode and prefill) are
checked against the reference, with decodes, prefill chunks on a cached prefix and fresh prompts
in one step, with and without a window.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from kvfleet.engine.attention import LayerKV, get_backend
from kvfleet.engine.attention.cpu_backend import CpuAttentionBackend
from kvfleet.engine.attention.torch_backend import paged_attention_reference
from kvfleet.engine.kernels.native.paged_prefill import load_prefill

from .steps import step_metadata


@pytest.mark.parametrize("window", [None, 4])
def test_the_reference_with_sinks_equals_transformers_gpt_oss_attention(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, length = 4, 2, 16, 4, 11
    keys = torch.randn(length, kv_heads, dim, generator=gen)
    values = torch.randn(length, kv_heads, dim, generator=gen)
    q = torch.randn(length, heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    k_cache = torch.zeros(3, block, kv_heads, dim)
    v_cache = torch.zeros(3, block, kv_heads, dim)
    for p in range(length):
        k_cache[int(table[0, p // block]), p % block] = keys[p]
        v_cache[int(table[0, p // block]), p % block] = values[p]
    meta = step_metadata([length], [length], table)
    ours = paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window, sinks)
    pos = torch.arange(length)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(length, length).masked_fill_(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    want, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        mask,
        dim**-0.5,
    )
    torch.testing.assert_close(ours, want[0], atol=1e-6, rtol=1e-5)
    no_sinks = paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window)
    assert not torch.allclose(ours, no_sinks, atol=1e-3), "the sinks were meant to change the output"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 3, 20])
@pytest.mark.parametrize("head_dim", [16, 64, 24])
def test_each_cpu_backend_with_sinks_equals_the_reference_for_decodes_chunks_and_fresh_prompts(
    backend: str, window: int | None, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, block = 8, 2, 4
    k_cache = torch.randn(64, block, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(64, block, kv_heads, head_dim, generator=gen)
    # decodes of ragged lengths, a chunk of 5 rows on 9 cached keys, a fresh prompt of 37 rows
    seq_lens, query_lens = [9, 1, 14, 37, 23], [1, 1, 5, 37, 1]
    perm = torch.randperm(64, generator=gen)
    tables = perm[:60].view(5, 12).to(torch.int32)
    meta = step_metadata(seq_lens, query_lens, tables)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 3
    scale = head_dim**-0.5
    attention = get_backend(backend)
    native = load_prefill()
    if backend == "cpu" and head_dim % 16 == 0 and native is not None and native.preferred:
        # the prefill chunks go to the native kernel's sinks entry point, not to SDPA
        assert isinstance(attention, CpuAttentionBackend)
        assert attention.prefills_natively(heads, kv_heads, head_dim)
    ours = attention.forward(q, LayerKV(k_cache, v_cache, scale, window, sinks), meta)
    want = paged_attention_reference(q, k_cache, v_cache, meta, scale, window, sinks)
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=2e-5)
