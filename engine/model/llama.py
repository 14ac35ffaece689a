"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) in plain torch, over one flat token batch.

Where it sits: the runner flattens a scheduler plan into ``input_ids`` and ``positions``
of shape (T,) plus one :class:`AttentionMetadata`, and calls :meth:`LlamaForCausalLM.forward`;
each attention layer writes its new K/V into its paged cache through the attention backend
and attends over the sequence's blocks. The LM head runs only at the rows that sample.

Submodule names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``
...) so ``state_dict`` keys are the safetensors names; the numerics follow transformers
(RMSNorm in float32, RoPE cos/sin in float32, rotate-half layout) so greedy output is
the same token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata
from kvfleet.engine.model.config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin at arbitrary positions: every token carries its own position, so no batch is padded."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.inv_freq: torch.Tensor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, head_dim)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns float32 logits (len(sample_rows), vocab) for the rows that sample."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta, backend)
        x = self.model.norm(x[sample_rows])
        return self.lm_head(x).float()
