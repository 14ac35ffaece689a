"""The CPU's branch-free bitmask application gives exactly xgrammar's own."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kvfleet.engine.structured.bitmask import apply_bitmask


@pytest.mark.parametrize(
    ("rows", "vocab_size"), [([0, 1, 2, 3, 4], 100), ([1, 3], 100), ([2], 90), ([0, 1, 2, 3, 4], 70)]
)
def test_apply_bitmask_refuses_exactly_what_xgrammar_refuses(rows: list[int], vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(len(rows) * 1000 + vocab_size)
    logits = torch.randn(5, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size, indices=rows)
    apply_bitmask(logits, bitmask, rows, vocab_size)
    assert torch.equal(logits, expected)
    refused = int((logits == float("-inf")).sum())
    assert 0 < refused < len(rows) * vocab_size
