"""The ``cpu`` attention backend: decodes and prefill chunks through the native kernels.

Where it sits: the runner's default on a CPU (``attention_backend="auto"``) when the native
library of :mod:`kvfleet.engine.kernels.native.paged_decode` builds on the machine. Per layer and step
it hands the decoding sequences (one query row each) to the decode kernel and the prefill
chunks (more than one row) to the prefill kernel of :mod:`kvfleet.engine.kernels.native.paged_prefill`;
both read K/V rows in place through the block table instead of gathering them into a padded
copy first. A geometry the prefill kernel does not take (a head size not a multiple of 16),
or a build without AVX-512 (where the kernel measured slower than SDPA), runs the prefill
chunks on the torch backend's batched SDPA path instead.

Float32 only: with another dtype, or tensors off the CPU, it falls back to the torch
backend's path for the whole step, so it is never wrong, only sometimes no faster. Since the
kernel reads raw memory, shapes are checked per call and the step's offsets, lengths and
block ids once per step (``kvfleet.engine.attention.checks``): a bad one is a ValueError.
A layer with attention sinks (gpt-oss) hands them to both kernels' sinks entry points.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvfleet.engine.attention.base import AttentionMetadata, LayerKV
from kvfleet.engine.attention.checks import check_cache, check_forward, check_paged_bounds
from kvfleet.engine.attention.torch_backend import TorchAttentionBackend
from kvfleet.engine.attention.torch_batched import BatchedAttention
from kvfleet.engine.kernels.native.paged_decode import NativeDecode, PagedCache, load_kernel
from kvfleet.engine.kernels.native.paged_prefill import NativePrefill, load_prefill, prefill_ok


class CpuKernelUnavailable(RuntimeError):
    """The native CPU kernel could not be built here (no C compiler, or the build failed)."""


def require_kernel() -> NativeDecode:
    kernel, reason = load_kernel()
    if kernel is None:
        raise CpuKernelUnavailable(
            f"attention backend 'cpu' needs its native kernel: {reason}; "
            "use attention_backend='torch' (or 'auto', which falls back to it)"
        )
    return kernel


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._kernel = require_kernel()
        self._prefill = BatchedAttention(sdpa_decodes=False)
        prefill = load_prefill()
        self._native_prefill: NativePrefill | None = prefill if prefill and prefill.preferred else None
        self._checked: AttentionMetadata | None = None  # the last step whose bounds were checked
        self._split: tuple[AttentionMetadata, RowSplit] | None = None

    def forward(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache, scale, sliding_window, sinks = layer
        if not _native_ok(q, k_cache, v_cache, meta):
            return super().forward(q, layer, meta)
        check_cache(k_cache, v_cache)
        check_forward(q, k_cache, meta, sliding_window)
        if meta is not self._checked:  # the step's values, once for all its layers
            check_paged_bounds(q, k_cache, meta)
            self._checked = meta
        q = q.contiguous()
        if sinks is not None:
            sinks = sinks.detach().float().contiguous()
        out = torch.empty_like(q)
        paged = PagedCache(k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        native_prefill = self._native_prefill if prefill_ok(q.shape[1], *k_cache.shape[2:]) else None
        if native_prefill is None:  # a geometry the prefill kernel does not take: SDPA for the chunks
            layout = self._prefill.layout(meta, BatchedAttention.geometry(q, k_cache))
            if layout.decode_seqs is not None:
                self._kernel(q, paged, layout.decode_seqs, out, scale, sliding_window, sinks)
            if layout.has_prefill:
                self._prefill.forward(q, layer, meta, out=out)
            return out
        decodes, prefills = self.split(meta)
        if decodes is not None:
            self._kernel(q, paged, decodes, out, scale, sliding_window, sinks)
        if prefills is not None:
            native_prefill(q, paged, prefills, out, scale, sliding_window, sinks)
        return out

    def prefills_natively(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether prompt chunks of this geometry run on the native prefill kernel (else on SDPA)."""
        return self._native_prefill is not None and prefill_ok(heads, kv_heads, head_dim)

    def split(self, meta: AttentionMetadata) -> RowSplit:
        """The step's decoding sequences and its prefill chunks, computed once for all its layers."""
        if self._split is None or self._split[0] is not meta:
            self._split = (meta, split_rows(meta.query_start_loc))
        return self._split[1]


class RowSplit(NamedTuple):
    """A step's sequences by query rows, as int64 index tensors (None: there are none)."""

    decodes: torch.Tensor | None  # one query row each
    prefills: torch.Tensor | None  # more than one: a prompt chunk


def split_rows(query_start_loc: torch.Tensor) -> RowSplit:
    rows = query_start_loc[1:] - query_start_loc[:-1]
    decodes = torch.nonzero(rows == 1).flatten()
    prefills = torch.nonzero(rows > 1).flatten()
    return RowSplit(decodes if decodes.numel() else None, prefills if prefills.numel() else None)


def _native_ok(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> bool:
    tensors = (q, k_cache, v_cache)
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and meta.block_tables.dtype == torch.int32
        and meta.block_tables.stride(1) == 1
        and all(t.dtype == torch.int32 and t.is_contiguous() for t in (meta.seq_lens, meta.query_start_loc))
    )
