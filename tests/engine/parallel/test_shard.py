"""Each rank's heads, columns and vocabulary rows at tensor-parallel size tp: exact ranges, and the splits refused."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.parallel.shard import AxisSpan as Span
from kvfleet.engine.parallel.shard import all_shards, contiguous_split, lora_slices, rank_shard


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    intermediate_size: int = 160
    vocab_size: int = 259


def spans(shape: Shape, tp: int) -> list[tuple[Span, Span]]:
    return [(s.q_heads, s.kv_heads) for s in all_shards(shape, tp)]


def test_gqa_splits_whole_groups_evenly() -> None:
    # 8 query heads over 4 KV heads (groups of 2), tp=2: two KV heads and their four query heads each.
    assert spans(Shape(8, 4), 2) == [(Span(0, 4), Span(0, 2)), (Span(4, 8), Span(2, 4))]
    assert spans(Shape(8, 4), 4) == [(Span(2 * r, 2 * r + 2), Span(r, r + 1)) for r in range(4)]


def test_smollm2_nine_heads_over_three_kv_heads_at_tp2_splits_unevenly_by_group() -> None:
    shards = all_shards(Shape(9, 3, intermediate_size=1536, vocab_size=49152), 2)
    assert [(s.q_heads, s.kv_heads) for s in shards] == [(Span(0, 6), Span(0, 2)), (Span(6, 9), Span(2, 3))]
    assert [s.intermediate for s in shards] == [Span(0, 768), Span(768, 1536)]
    assert [s.vocab for s in shards] == [Span(0, 24576), Span(24576, 49152)]
    assert [s.holds_row_parallel_bias for s in shards] == [True, False]


def test_mqa_replicates_the_one_kv_head_and_splits_the_query_heads() -> None:
    assert spans(Shape(4, 1), 2) == [(Span(0, 2), Span(0, 1)), (Span(2, 4), Span(0, 1))]
    # 8 heads over 2 KV heads at tp=4: each KV head on two ranks, each with two of its four query heads.
    assert spans(Shape(8, 2), 4) == [
        (Span(0, 2), Span(0, 1)),
        (Span(2, 4), Span(0, 1)),
        (Span(4, 6), Span(1, 2)),
        (Span(6, 8), Span(1, 2)),
    ]


def test_uneven_columns_give_the_first_ranks_one_more() -> None:
    assert [contiguous_split(259, 2, r) for r in range(2)] == [Span(0, 130), Span(130, 259)]
    assert [contiguous_split(10, 4, r) for r in range(4)] == [Span(0, 3), Span(3, 6), Span(6, 8), Span(8, 10)]


def test_tp1_holds_everything() -> None:
    (only,) = all_shards(Shape(9, 3), 1)
    assert (only.q_heads, only.kv_heads, only.intermediate, only.vocab) == (
        Span(0, 9),
        Span(0, 3),
        Span(0, 160),
        Span(0, 259),
    )


def test_lora_slices_cut_column_parallel_outputs_and_row_parallel_inputs() -> None:
    shard = rank_shard(Shape(9, 3, intermediate_size=1536), 2, 1)
    sl = lora_slices(shard, head_dim=64)
    assert sl["q_proj"] == (None, slice(384, 576)) and sl["k_proj"] == (None, slice(128, 192))
    assert sl["o_proj"] == (slice(384, 576), None) and sl["down_proj"] == (slice(768, 1536), None)
    assert sl["gate_proj"] == sl["up_proj"] == (None, slice(768, 1536))


@pytest.mark.parametrize(
    ("shape", "tp", "needle"),
    [
        (Shape(9, 3), 4, "tensor_parallel_size=4 exceeds num_key_value_heads=3"),  # 4 % 3 != 0
        (Shape(6, 2), 4, "num_attention_heads % tp == 0 (num_attention_heads=6)"),  # 6 % 4 != 0
        (
            Shape(4, 1, intermediate_size=2),
            4,
            "intermediate_size=2 cannot be split over tensor_parallel_size=4",
        ),
        (Shape(6, 4), 2, "num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
    ],
)
def test_what_cannot_be_split_is_a_model_load_error_naming_sizes_and_tp(
    shape: Shape, tp: int, needle: str
) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(needle)):
        all_shards(shape, tp)


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="rank 2 of tensor_parallel_size=2"):
        rank_shard(Shape(4, 2), 2, 2)
