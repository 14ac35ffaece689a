"""Kernel tests: the Triton kernels against the torch reference, on the CPU under the interpreter.

``tests/conftest.py`` switches Triton's interpreter on (``TRITON_INTERPRET=1``) before
anything imports triton when there is no CUDA device; with CUDA the kernels are compiled
and the same tests run on the GPU. If triton was imported some other way first, the
kernels cannot run on the CPU, and the run stops here with the reason.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.attention.base import AttentionMetadata
from kvfleet.engine.attention.torch_backend import store_kv_reference
from kvfleet.engine.kernels.linear import resolve_linear
from kvfleet.engine.kernels.triton import paged_attention

if not torch.cuda.is_available() and not paged_attention.INTERPRETED:
    raise pytest.UsageError(
        "no CUDA device and triton was imported without TRITON_INTERPRET=1: "
        "run pytest from the repository root so tests/conftest.py sets it first"
    )


# The native CPU kernels are built with the machine's C compiler; without one their tests skip
# and the torch fallbacks' tests still run.
HAVE_COMPILER = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler on this machine")


@pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count (which the native kernels follow) for the test, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def linear_case(rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, k), weight (n, k) and bias (n,), drawn in that order from a generator seeded by the shape."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    return (
        torch.randn(rows, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )


def assert_packed_is_f_linear(
    packed: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tol: dict[str, float]
) -> None:
    """A packed weight equals ``F.linear`` without and with a bias, called itself and through ``resolve_linear``."""
    with torch.inference_mode():
        torch.testing.assert_close(packed(x, None), F.linear(x, weight), **tol)
        torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), **tol)
        # through the model's entry point (at more rows than the native few-row kernel takes, too)
        torch.testing.assert_close(resolve_linear(weight, bias, packed)(x), F.linear(x, weight, bias), **tol)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class PagedBatch:
    """A step's queries over a paged cache whose unowned slots hold NaN."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def heads(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> dict[str, int]:
    """A batch's attention shape, as ``make_paged_batch`` takes it: ``paged_batch(seqs, **heads(4, 2, 64, 16))``."""
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
    }


# MHA, GQA 2 and GQA 4 (num_heads, num_kv_heads, head_dim, block_size): every paged-attention kernel checks these
MHA_GQA2_GQA4 = ((2, 2, 64, 16), (4, 2, 128, 8), (8, 2, 64, 32))


def shapes(*rows: tuple[int, int, int, int]) -> list[Any]:
    """(num_heads, num_kv_heads, head_dim, block_size) rows as values of a ``shape`` parameter, id'd by the row."""
    return [pytest.param(heads(*row), id="-".join(map(str, row))) for row in rows]


def make_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    strided_q: bool = False,
) -> PagedBatch:
    """``seqs`` is (seq_len, query_len) per sequence; blocks are scattered in a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    for s, (seq_len, _) in enumerate(seqs):
        owned = [pool.pop() for _ in range(blocks_per_seq[s])]
        tables[s, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        slots = torch.tensor([owned[i // block_size] * block_size + i % block_size for i in range(seq_len)])
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        store_kv_reference(k, v, k_cache, v_cache, slots)
    query_lens = [query_len for _, query_len in seqs]
    total = sum(query_lens)
    if strided_q:  # a view into a fused qkv projection, as the model runner produces
        qkv = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        q = qkv[:, :num_heads]
    else:
        q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(total, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_len for seq_len, _ in seqs),
    )
    return PagedBatch(q.to(device), k_cache.to(device), v_cache.to(device), meta)


def run_triton(batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    """The Triton paged attention over ``batch`` (the kernel's positional call, in one place)."""
    m = batch.meta
    return paged_attention.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.seq_lens, m.query_start_loc,
        m.max_query_len, scale, window,
    )  # fmt: skip


@pytest.fixture
def paged_batch() -> Iterator[Callable[..., PagedBatch]]:
    yield make_paged_batch
