"""The pooling forward: a prompt's final hidden states pooled into one embedding, no KV cache, no sampling.

Where it sits: in ``--runner pooling`` the engine core hands the runner a batch of prompts
(``engine/core/pooling.py``), whose ``pool`` calls :func:`pool` here. The decoder's own layers
run over the flat batch as in a prefill step, but with :class:`NoCacheAttention` as their
backend: each layer's keys and values stay inside the step (nothing is written to the paged
cache), and every row attends to its own sequence's keys causally, as a prefill would. The
final norm's output (transformers' last ``hidden_states``) is pooled by the
:class:`~kvfleet.engine.model.pooler_config.PoolerConfig`'s pooler, looked up by name in
:data:`POOLERS`, truncated to the request's ``dimensions`` and normalised where the config says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfleet.engine.attention import AttentionMetadata, LayerKV
from kvfleet.engine.model.llama import LlamaForCausalLM, Step
from kvfleet.engine.model.pooler_config import PoolerConfig


class NoCacheAttention:
    """An attention backend that keeps each layer's K/V for the step only: padded causal SDPA per sequence."""

    name = "no-cache"

    def __init__(self, lens: list[int], device: torch.device) -> None:
        self.lens, self.longest = lens, max(lens)
        self.seq = torch.repeat_interleave(
            torch.arange(len(lens), device=device), torch.tensor(lens, device=device)
        )
        self.row = torch.cat([torch.arange(n, device=device) for n in lens])
        self._masks: dict[int | None, torch.Tensor] = {}
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        self._kv = (k, v)

    def _padded(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(T, h, D) rows → (S, heads, L, D), the kv heads repeated for their query-head group."""
        out = x.new_zeros(len(self.lens), self.longest, x.shape[1], x.shape[2])
        out[self.seq, self.row] = x
        return out.repeat_interleave(heads // x.shape[1], dim=2).transpose(1, 2)

    def _mask(self, window: int | None) -> torch.Tensor:
        # Invariant: row q of sequence s sees key k iff k <= q < len(s) or q is padding, k < len(s),
        # and (with a window W) k > q - W: a prefill's causal attention, windowed as transformers does.
        if window not in self._masks:
            device = self.seq.device
            pos = torch.arange(self.longest, device=device)
            valid = pos[None, :] < torch.tensor(self.lens, device=device)[:, None]  # (S, L) keys
            mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]
            if window is not None:
                mask &= (pos[None, :] > pos[:, None] - window)[None]
            self._masks[window] = mask[:, None]  # (S, 1, L, L)
        return self._masks[window]

    def forward(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        assert self._kv is not None, "store_kv runs first"
        k, v = self._kv
        heads = q.shape[1]
        out = F.scaled_dot_product_attention(
            self._padded(q, heads), self._padded(k, heads), self._padded(v, heads),
            attn_mask=self._mask(layer.sliding_window), scale=layer.scale,
        )  # fmt: skip
        return out.transpose(1, 2)[self.seq, self.row]


def final_hidden_states(model: LlamaForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """(T, hidden): every prompt token's hidden state after the final norm, the prompts' rows back to back."""
    device = model.lm_head.weight.device
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        block_tables=torch.zeros((len(lens), 1), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    x = model.model.embed_tokens(ids)
    step = Step(model.model.rotary_emb(positions, meta, x.dtype), meta, NoCacheAttention(lens, device))  # type: ignore[arg-type]
    no_cache = torch.empty((2, 0), dtype=x.dtype, device=device)
    residual: torch.Tensor | None = None
    for layer in model.model.layers:
        x, residual = layer(x, no_cache, step, residual)
    return model.model.norm(x if residual is None else x + residual)


def _segments(hidden: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(torch.split(hidden, lens))


POOLERS: dict[str, Callable[[torch.Tensor, list[int]], torch.Tensor]] = {
    "LAST": lambda h, lens: torch.stack([s[-1] for s in _segments(h, lens)]),
    "MEAN": lambda h, lens: torch.stack([s.float().mean(dim=0) for s in _segments(h, lens)]),
    "CLS": lambda h, lens: torch.stack(
        [s[0] for s in _segments(h, lens)]
    ),  # the first token (BOS in a decoder)
}


@torch.inference_mode()
def pool(
    model: LlamaForCausalLM, prompts: list[list[int]], cfg: PoolerConfig, dimensions: int | None = None
) -> torch.Tensor:
    """(len(prompts), dimensions or hidden) float32 embeddings, one per prompt."""
    pooled = POOLERS[cfg.pooling_type](final_hidden_states(model, prompts), [len(p) for p in prompts]).float()
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if cfg.normalize else pooled


def pool_to_bytes(
    model: LlamaForCausalLM, prompts: list[list[int]], cfg: PoolerConfig, dimensions: int | None
) -> list[bytes]:
    """The runner's ``pool``: each embedding as little-endian float32 bytes (what crosses the core link,
    and what OpenAI's base64 ``encoding_format`` encodes); a bad ``dimensions`` is a RequestError."""
    cfg.check_dimensions(dimensions, model.config.hidden_size)
    vectors = pool(model, prompts, cfg, dimensions).cpu().numpy().astype("<f4")
    return [v.tobytes() for v in vectors]
