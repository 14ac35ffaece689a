"""KVCacheManager with a sliding window (every layer slides): blocks out of the window go back to the
pool as the sequence grows, keep their hashes for prefix hits, and are not freed twice (block size 4)."""

from kvfleet.engine.kv.kv_cache_manager import FREED_BLOCK, KVCacheManager
from kvfleet.engine.model.config import ModelConfig

from .steps import computed, decode, seq


def test_frees_blocks_that_fall_out_of_every_window() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    a = seq(list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    computed(kv, a, 10)
    # The 11th token (position 10) reads keys 5..10: block 0 (positions 0..3) is read by nobody.
    assert decode(kv, a, 100) == []
    assert a.block_ids == [FREED_BLOCK, 1, 2] and kv.freed_blocks(a) == 1
    assert kv.pool.free_block_ids()[-1] == 0 and kv.num_free_blocks == 8
    assert decode(kv, a, 101) == []  # position 11 reads 6..11: block 1 still needed
    assert decode(kv, a, 102) == [3]  # position 12 reads 7..12: block 1 still needed
    assert a.block_ids == [FREED_BLOCK, 1, 2, 3]
    assert decode(kv, a, 103) == []  # position 13 reads 8..13: block 1 (4..7) freed
    assert a.block_ids == [FREED_BLOCK, FREED_BLOCK, 2, 3] and kv.freed_blocks(a) == 2
    assert kv.pool.free_block_ids()[-2:] == [0, 1]
    assert kv.window_freed_blocks == 2


def test_freeing_the_sequence_gives_back_only_the_blocks_it_still_holds() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    a = seq(list(range(10)))
    kv.allocate_slots(a, 10)
    computed(kv, a, 10)
    decode(kv, a, 100)
    kv.free(a)
    assert kv.num_free_blocks == 10 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_freed_block_keeps_its_hash_so_a_prompt_sharing_the_prefix_still_hits_it() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    a = seq(list(range(10)), "a")
    kv.allocate_slots(a, 10)
    computed(kv, a, 10)
    decode(kv, a, 100)
    assert a.block_ids[0] == FREED_BLOCK
    b = seq([*range(9), 77], "b")
    hit = kv.find_cached_prefix(b)
    assert (hit.block_ids, hit.num_tokens) == ((0, 1), 8)
    assert kv.allocate_slots(b, 2, hit) == [3]
    assert b.block_ids == [0, 1, 3] and kv.pool.blocks[0].ref_cnt == 1  # revived from the free queue


def test_without_a_window_nothing_is_freed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)))
    kv.allocate_slots(a, 10)
    computed(kv, a, 10)
    for t in range(100, 110):
        decode(kv, a, t)
    assert FREED_BLOCK not in a.block_ids[1:] and kv.window_freed_blocks == 0


def _config(architecture: str, **more: object) -> ModelConfig:
    raw = {"architectures": [architecture], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8}
    return ModelConfig.from_dict(raw | {"num_hidden_layers": 2, "num_attention_heads": 2} | more)


def test_only_a_model_whose_every_layer_slides_has_a_window_to_free_blocks_by() -> None:
    assert _config("MistralForCausalLM", sliding_window=7).kv_window == 7
    assert _config("LlamaForCausalLM").kv_window is None
    both = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
    assert _config("Gemma3ForCausalLM", **both).kv_window is None  # its global layer reads every block
    all_sliding = {"sliding_window": 6, "layer_types": ["sliding_attention", "sliding_attention"]}
    assert _config("Gemma3ForCausalLM", **all_sliding).kv_window == 6
