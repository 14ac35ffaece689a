"""The arithmetic of bench/peers/peers_bounds.py: the least work a cell of bench/peers/peers.py needs.

A perfect prefix cache computes each distinct prefix once (the trie counts positions); requests
that arrive together give their first tokens one by one, the k-th after k prompts' private
tokens and one shared prefix, the last after every distinct position; one at a time, each after the tokens no earlier request computed.
vLLM's best figures per cell are read from a peers results file.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]  # bench/ is a package run from the repository root


@pytest.fixture(scope="module")
def bounds() -> ModuleType:
    added = str(ROOT) not in sys.path
    if added:
        sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("bench.peers.peers_bounds")
    finally:
        if added:
            sys.path.remove(str(ROOT))


def test_the_trie_counts_new_positions_and_each_sequences_private_tail(bounds: ModuleType) -> None:
    trie = bounds.Trie()
    assert trie.add([1, 2, 3, 4]) == 4
    assert trie.add([1, 2, 5]) == 1  # shares [1, 2]
    assert trie.add([1, 2, 3, 4]) == 0  # all cached
    assert trie.add([9]) == 1
    assert [trie.private(p) for p in ([1, 2, 5], [9], [1, 2, 3, 4])] == [1, 1, 0]


def test_a_cost_counts_matmuls_per_new_position_and_causal_attention(bounds: ModuleType) -> None:
    shape = bounds.peers.Shape(params=10, lm_head=100, layers=2, q_width=3)
    cost = bounds.Cost(shape)
    assert cost(4) == 20 * 4 + 12 * 16
    assert cost(4, 3) == 20 * 1 + 12 * (16 - 9)


def test_requests_one_at_a_time_are_bounded_by_what_no_earlier_one_computed(bounds: ModuleType) -> None:
    cost = bounds.Cost(bounds.peers.Shape(params=1, lm_head=0, layers=0, q_width=0))  # 2 FLOPs a position
    assert bounds.ttft_bounds([[1, 2, 3], [1, 2, 4, 5], [7]], 1, cost) == [6, 4, 2]


def test_requests_together_give_the_kth_first_token_after_k_private_tails_and_one_prefix(
    bounds: ModuleType,
) -> None:
    cost = bounds.Cost(bounds.peers.Shape(params=1, lm_head=0, layers=0, q_width=0))
    wave = [[1, 2, 3], [1, 2, 4, 5], [1, 2, 6, 7, 8]]  # shared [1, 2]; private 1, 2 and 3 positions
    # the last: every distinct position (2 shared + 1 + 2 + 3 private = 8), here the same count
    assert bounds.ttft_bounds(wave, 3, cost) == [2 * (1 + 2), 2 * (1 + 2 + 2), 2 * (1 + 2 + 3 + 2)]
    deep = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 8]]  # privates 1, 1, 1; shares 2 to 5
    assert bounds.ttft_bounds(deep, 3, cost)[-1] == 2 * 8  # not 2 * (3 + 2): 8 distinct positions
    later = bounds.ttft_bounds([*wave, [9]], 3, cost)
    assert later[-1] == later[-2]  # beyond the first wave, no tighter bound is claimed


def test_vllms_best_row_per_cell_is_read_from_a_results_file(bounds: ModuleType, tmp_path: Path) -> None:
    results = tmp_path / "peers.txt"
    results.write_text(
        "vLLM LLM.generate, threads=2 (2 torch)                       32.78       78.6       382.0    66.9\n"
        "vLLM LLM.generate, threads=default (1 torch)                 40.00       60.0       300.0    50.0\n"
        "vLLM server, threads=2      random       8      52.9       243.1        4128/4128           78/92    42.6      0\n"
        "vLLM server, threads=default random      8      50.0       250.0        4000/4500           78/92    42.6      0\n"
        "kvfleet engine, threads=2   random       8      69.2       318.1        3750/3752           54/61    55.7      0\n"
    )
    offline, cells = bounds.vllm_best(results)
    assert offline == 32.78
    assert cells == {("random", 8): (250.0, 4.128)}
