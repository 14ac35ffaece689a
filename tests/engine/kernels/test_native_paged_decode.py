"""The native CPU decode kernel and the ``cpu`` backend against the torch reference.

The kernel is compiled here with the machine's C compiler (``make test`` installs gcc where
it is missing); with no compiler at all the kernel tests skip, and the fallback tests still
run. A compiler that is present but fails to build the kernel is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata, LayerKV, get_backend, torch_batched
from kvfleet.engine.attention.torch_backend import paged_attention_reference
from kvfleet.engine.kernels.native import build, paged_decode
from kvfleet.engine.kernels.native.paged_decode import PagedCache
from kvfleet.engine.runner.model_runner import resolve_backend

from .conftest import MHA_GQA2_GQA4, heads, needs_compiler, shapes

DECODES = [(9, 1), (1, 1), (33, 1), (16, 1), (70, 1), (17, 1)]
# (seq_len, query_len): a whole prefill, a chunked prefill across a block boundary, decodes
MIXED = [(19, 19), (41, 9), (33, 1), (1, 1), (16, 1)]


@pytest.fixture
def fresh_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache of the test's own, and ``load_kernel`` forgotten before and after."""
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path))
    paged_decode.load_kernel.cache_clear()
    yield tmp_path / "kernels"
    paged_decode.load_kernel.cache_clear()


def _reference(batch, scale: float, window: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)


def _cpu(batch, scale: float, window: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return get_backend("cpu").forward(
        batch.q, LayerKV(batch.k_cache, batch.v_cache, scale, window), batch.meta
    )


@needs_compiler
@pytest.mark.parametrize("seqs", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize(
    "shape",
    shapes(
        *MHA_GQA2_GQA4,
        (8, 1, 32, 16),  # GQA 8, the tiny model's head size
        (4, 1, 80, 8),  # head_dim without a specialised copy
        (7, 1, 64, 1),  # GQA 7 (Qwen2-7B's ratio); one token per block
        (3, 3, 17, 4),  # odd head_dim, no GQA
    ),
)
def test_decodes_among_prefills_match_the_reference_without_reading_unowned_slots(
    paged_batch: Callable, seqs: list[tuple[int, int]], shape: dict[str, int]
) -> None:
    # unowned slots hold NaN (make_paged_batch): one read of them would poison a whole row
    batch = paged_batch(seqs, **shape)
    scale = shape["head_dim"] ** -0.5
    out = _cpu(batch, scale)
    assert out.shape == batch.q.shape and not out.isnan().any()
    torch.testing.assert_close(out, _reference(batch, scale), atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 32), (8, 2, 64), (4, 1, 128), (4, 2, 80)]
)
def test_the_portable_loops_match_the_reference_where_the_cpu_has_vector_code_for_the_shape(
    paged_batch: Callable, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # built without AVX-512, the kernel runs the portable loops that CPUs without it get
    portable, reason = paged_decode.build_kernel((*build.FLAGS, "-mno-avx512f"))
    assert portable is not None, reason
    batch = paged_batch(DECODES, **heads(num_heads, num_kv_heads, head_dim, 8))
    meta, out = batch.meta, torch.empty_like(batch.q)
    everyone = torch.arange(len(DECODES), dtype=torch.int64)
    paged = PagedCache(batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    portable(batch.q, paged, everyone, out, head_dim**-0.5, 7)
    torch.testing.assert_close(out, _reference(batch, head_dim**-0.5, 7), atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
def test_a_sliding_window_reads_only_the_last_window_keys(paged_batch: Callable, window: int) -> None:
    batch = paged_batch([(155, 1), (120, 40), (70, 1), (5, 1), (33, 1)], **heads(8, 2, 64, 16))
    out = _cpu(batch, 0.125, window)
    torch.testing.assert_close(out, _reference(batch, 0.125, window), atol=2e-5, rtol=2e-5)


@needs_compiler
def test_queries_read_as_a_strided_view_of_a_fused_qkv_projection(paged_batch: Callable) -> None:
    batch = paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, strided_q=True)
    assert not batch.q.is_contiguous()
    torch.testing.assert_close(_cpu(batch, 0.2), _reference(batch, 0.2), atol=2e-5, rtol=2e-5)


@needs_compiler
def test_the_kernel_writes_the_rows_of_the_listed_sequences_and_no_other(paged_batch: Callable) -> None:
    batch = paged_batch(DECODES, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    kernel, reason = paged_decode.load_kernel()
    assert kernel is not None, reason
    meta = batch.meta
    out = torch.full_like(batch.q, 7.0)
    listed = torch.tensor([4, 0, 2], dtype=torch.int64)
    paged = PagedCache(batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    kernel(batch.q, paged, listed, out, 0.3, None)
    expected = _reference(batch, 0.3)
    for s in range(len(DECODES)):
        if s in listed.tolist():
            torch.testing.assert_close(out[s], expected[s], atol=2e-5, rtol=2e-5)
        else:
            assert torch.equal(out[s], torch.full_like(out[s], 7.0))


@needs_compiler
def test_the_result_does_not_depend_on_the_thread_count(paged_batch: Callable) -> None:
    batch = paged_batch(DECODES * 4, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(_cpu(batch, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])  # each sequence is one work item: same arithmetic, same bits


@needs_compiler
def test_a_bfloat16_cache_takes_the_torch_path_and_gets_its_result(paged_batch: Callable) -> None:
    batch = paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.bfloat16)
    out = _cpu(batch, 0.2)
    ref = get_backend("torch").forward(batch.q, LayerKV(batch.k_cache, batch.v_cache, 0.2), batch.meta)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_compiler)])
def test_long_prefill_chunks_cut_into_tiles_see_exactly_their_causal_keys(
    paged_batch: Callable, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    # 4-row tiles: chunks of 19, 9 and 40 rows become 5, 3 and 10 tiles, each attending keys up to its last row
    monkeypatch.setattr(torch_batched, "PREFILL_TILE", 4)
    batch = paged_batch(
        [(19, 19), (41, 9), (33, 1), (80, 40), (7, 3)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8
    )
    for window in (None, 6):
        out = get_backend(backend).forward(
            batch.q, LayerKV(batch.k_cache, batch.v_cache, 0.2, window), batch.meta
        )
        assert not out.isnan().any()
        torch.testing.assert_close(out, _reference(batch, 0.2, window), atol=2e-5, rtol=2e-5)


@needs_compiler
def test_the_kernel_is_built_once_into_the_cache_and_reused(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert paged_decode.load_kernel().kernel is not None, paged_decode.load_kernel().reason
    built = list(fresh_kernel.iterdir())
    assert len(built) == 1 and built[0].name.startswith("paged_decode-"), "no temporary file is left behind"
    paged_decode.load_kernel.cache_clear()

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached kernel should have been loaded, not rebuilt")

    monkeypatch.setattr(build.subprocess, "run", no_compiler)
    assert paged_decode.load_kernel().kernel is not None
    assert list(fresh_kernel.iterdir()) == built


def test_auto_falls_back_to_torch_when_no_compiler_exists(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(fresh_kernel.parent / "no-such-cc"))
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert "no-such-cc" in (paged_decode.load_kernel().reason or "")
    from kvfleet.engine.attention.cpu_backend import CpuKernelUnavailable

    with pytest.raises(CpuKernelUnavailable, match=r"'cpu' needs its native kernel.*no-such-cc.*'torch'"):
        get_backend("cpu")


def test_a_failed_build_is_reported_with_the_compiler_output(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = fresh_kernel.parent / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'paged_decode.c:1: error: no vectors today' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(broken))
    kernel, reason = paged_decode.load_kernel()
    assert kernel is None and "no vectors today" in (reason or "")
    assert not list(fresh_kernel.glob("*")), "a failed build leaves nothing in the cache"


def test_auto_means_triton_on_a_gpu_torch_without_triton_and_names_are_kept_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("auto", torch.device("mps")) == "torch"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real(n, *a))
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_a_chunk_is_cut_into_tiles_that_end_at_their_own_last_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch_batched, "PREFILL_TILE", 4)
    # 9 new rows from flat row 19, the last at position 40: tiles end at positions 35, 39 and 40
    assert torch_batched._tiles(19, 9, 41, [3, 1]) == [
        torch_batched.Span(19, 4, 36, [3, 1]),
        torch_batched.Span(23, 4, 40, [3, 1]),
        torch_batched.Span(27, 1, 41, [3, 1]),
    ]
    assert torch_batched._tiles(0, 4, 4, [0]) == [torch_batched.Span(0, 4, 4, [0])]


def _one_decode(block_ids: list[int], seq_len: int, rows: int = 1) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        block_tables=torch.tensor([block_ids], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
        max_query_len=rows,
        max_seq_len=seq_len,
    )


@needs_compiler
@pytest.mark.parametrize(
    ("q_rows", "meta", "message"),
    [
        (1, _one_decode([0, 9], 12), r"block_tables name blocks 0\.\.9, the cache has 0\.\.3"),
        (1, _one_decode([0, -1], 12), r"block_tables name blocks -1\.\.0"),
        (1, _one_decode([1], 9), r"seq_len 9 exceeds its block table \(8 token slots\)"),
        (2, _one_decode([1, 2], 12), r"query_start_loc must rise from 0 to the 2 query rows"),
        (3, _one_decode([1], 2, rows=3), "seq_len must be at least 1 and cover its query rows"),
    ],
)
def test_a_step_that_names_memory_outside_q_or_the_cache_is_refused_before_the_kernel_reads(
    q_rows: int, meta: AttentionMetadata, message: str
) -> None:
    cache = torch.zeros(4, 8, 2, 32)
    backend = get_backend("cpu")
    with pytest.raises(ValueError, match=message):
        backend.forward(torch.zeros(q_rows, 4, 32), LayerKV(cache, cache.clone(), 1.0), meta)
    # nothing is kept from the refused step: a good one runs next
    good = _one_decode([1, 2], 12)
    assert backend.forward(torch.ones(1, 4, 32), LayerKV(cache, cache.clone(), 1.0), good).shape == (1, 4, 32)


@needs_compiler
@pytest.mark.parametrize(
    ("q_shape", "window", "message"),
    [
        ((1, 3, 32), None, "num_heads 3 is not a multiple of num_kv_heads 2"),
        ((1, 4, 16), None, r"q must be \(T, num_heads, 32\), got \(1, 4, 16\)"),
        ((1, 4, 32), 0, "sliding_window must be at least 1 token, got 0"),
    ],
)
def test_shapes_the_kernel_cannot_serve_are_refused_naming_them(
    q_shape: tuple[int, ...], window: int | None, message: str
) -> None:
    cache = torch.zeros(4, 8, 2, 32)
    with pytest.raises(ValueError, match=message):
        get_backend("cpu").forward(
            torch.zeros(q_shape), LayerKV(cache, cache.clone(), 1.0, window), _one_decode([1, 2], 12)
        )


@needs_compiler
def test_a_damaged_kernel_in_the_cache_is_built_again(fresh_kernel: Path) -> None:
    assert paged_decode.load_kernel().kernel is not None, paged_decode.load_kernel().reason
    (built,) = fresh_kernel.glob("paged_decode-*.so")
    damaged = built.with_suffix(".damaged")
    damaged.write_bytes(b"not an ELF file")
    damaged.replace(built)  # a new file: this process keeps its mapping of the good one
    # a fresh process, which has not loaded the kernel, meets the damaged file
    code = "from kvfleet.engine.kernels.native import paged_decode as c; k, why = c.load_kernel(); print(k is not None, why)"
    env = {**os.environ, "KVFLEET_CACHE": str(fresh_kernel.parent)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True None", done.stderr
    assert built.read_bytes()[:4] == b"\x7fELF"
