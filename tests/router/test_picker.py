"""The picker's exact choices and scores on crafted loads, and the prefix index."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.protocol import EngineLoad
from kvfleet.router.config import PickerWeights
from kvfleet.router.picker import (
    Candidate,
    Choice,
    PickContext,
    choose,
    default_score,
    is_saturated,
    load_bound,
    policy,
)
from kvfleet.router.prefix import PrefixIndex, block_hashes, prompt_text

CTX = PickContext(
    weights=PickerWeights(prefix=2, kv=1, load=1, room=0, backlog=0),
    max_engine_queue=4,
    saturation_kv_usage=0.95,
)
DEFAULTS = PickContext(weights=PickerWeights(), max_engine_queue=4, saturation_kv_usage=0.95)


def load(kv: float = 0.0, waiting: int = 0, running: int = 0, seqs: int = 4) -> EngineLoad:
    return EngineLoad(
        model="m", kv_cache_usage=kv, num_waiting=waiting, num_running=running, max_num_seqs=seqs
    )


A = Candidate("http://a", load(kv=0.5, running=2), in_flight=2, prefix_blocks=0, prompt_blocks=4)
B = Candidate("http://b", load(kv=0.1, running=4, waiting=2), in_flight=6, prefix_blocks=4, prompt_blocks=4)
C = Candidate("http://c", load(kv=0.2, running=1), in_flight=3, prefix_blocks=2, prompt_blocks=4)


def test_round_robin_follows_the_rotation_whatever_the_load() -> None:
    picks = [choose([A, B, C], policy("round-robin"), CTX, r) for r in range(4)]
    assert [p.url for p in picks if p] == ["http://a", "http://b", "http://c", "http://a"]


def test_least_request_takes_the_larger_of_own_and_reported_counts() -> None:
    # busy: a=max(2,2)=2, b=max(6,6)=6, c=max(3,1)=3
    assert [A.busy, B.busy, C.busy] == [2, 6, 3]
    assert choose([A, B, C], policy("least-request"), CTX, 0) == Choice("http://a", -2.0)


def test_kv_aware_picks_the_lowest_kv_usage() -> None:
    assert choose([A, B, C], policy("kv-aware"), CTX, 0) == Choice("http://b", 0.9)


def test_prefix_aware_picks_the_longest_match_and_breaks_ties_by_load() -> None:
    assert choose([A, B, C], policy("prefix-aware"), CTX, 0) == Choice("http://b", 1.0)
    c2 = Candidate("http://c", load(running=1), in_flight=1, prefix_blocks=4, prompt_blocks=4)
    assert choose([B, c2], policy("prefix-aware"), CTX, 0) == Choice("http://c", 1.0)


def test_the_default_mix_weighs_prefix_kv_and_load() -> None:
    # a: (2*0 + 1*0.5 + 1*(1-2/8)) / 4 = 0.3125
    # b: (2*1 + 1*0.9 + 1*(1-6/8)) / 4 = 0.7875
    # c: (2*0.5 + 1*0.8 + 1*(1-3/8)) / 4 = 0.60625
    assert [default_score(x, CTX) for x in (A, B, C)] == pytest.approx([0.3125, 0.7875, 0.60625])
    choice = choose([A, B, C], policy("default"), CTX, 0)
    assert choice is not None and choice.url == "http://b"


def test_without_a_shared_prefix_the_default_mix_prefers_the_idle_engine() -> None:
    cold = [
        Candidate(u, load(kv=kv, running=r), in_flight=r, prompt_blocks=4)
        for u, kv, r in [("http://a", 0.3, 3), ("http://b", 0.3, 1), ("http://c", 0.6, 0)]
    ]
    # a: (0.7 + 5/8)/4 = 0.33125, b: (0.7 + 7/8)/4 = 0.39375, c: (0.4 + 1)/4 = 0.35
    assert choose(cold, policy("default"), CTX, 0) == Choice("http://b", pytest.approx(0.39375))


def test_the_load_bound_is_bounded_load_hashing_plus_a_slack_of_two() -> None:
    # ceil((1 + 1.0) * (sum(busy) + 1) / n) + 2
    idle = [Candidate(f"http://{i}", load(), in_flight=0) for i in range(4)]
    skewed = [Candidate(f"http://{i}", load(), in_flight=b) for i, b in enumerate((5, 1, 0, 0))]
    assert (load_bound(idle, DEFAULTS), load_bound(skewed, DEFAULTS)) == (3, 6)


def _fleet(home_busy: int) -> list[Candidate]:
    return [
        Candidate("http://home", load(kv=0.4, running=home_busy), in_flight=home_busy, prefix_blocks=4,
                  prompt_blocks=4, prompt_starts=2),
        Candidate("http://half", load(kv=0.2), in_flight=0, prefix_blocks=2, prompt_blocks=4, prompt_starts=2),
        Candidate("http://cold", load(kv=0.0), in_flight=0, prefix_blocks=0, prompt_blocks=4, prompt_starts=1),
        Candidate("http://idle", load(kv=0.1), in_flight=0, prefix_blocks=0, prompt_blocks=4, prompt_starts=2),
    ]  # fmt: skip


def test_the_default_follows_the_cached_prefix_while_that_engine_is_within_the_load_bound() -> None:
    # busy (4, 0, 0, 0): bound ceil(2 * 5 / 4) + 2 = 5, and home holds 4 + 1 <= 5.
    # home: (3*1 + 0.5*0.6 + 1*(1 - 4/8) + 1*(1 - 2/2) + 1*1) / 6.5 = 4.8 / 6.5 (no backlog anywhere)
    assert choose(_fleet(4), policy("default"), DEFAULTS, 0) == Choice(
        "http://home", pytest.approx(4.8 / 6.5)
    )


def test_past_the_load_bound_the_default_spills_to_the_best_other_engine() -> None:
    # busy (5, 0, 0, 0): bound ceil(2 * 6 / 4) + 2 = 5 < 5 + 1, so home is set aside.
    # half: (3*0.5 + 0.5*0.8 + 1 + 0 + 1) / 6.5 = 3.9 / 6.5; cold: (0 + 0.5 + 1 + 0.5 + 1) / 6.5 = 3 / 6.5
    assert choose(_fleet(5), policy("default"), DEFAULTS, 0) == Choice(
        "http://half", pytest.approx(3.9 / 6.5)
    )


def test_a_cold_prompt_goes_to_the_engine_sent_the_fewest_distinct_prompt_starts() -> None:
    cands = [
        Candidate(f"http://{n}", load(kv=0.1), in_flight=0, prompt_blocks=4, prompt_starts=k)
        for n, k in zip("abc", (3, 1, 2), strict=True)
    ]
    # b: (0 + 0.5*0.9 + 1 + 1*(1 - 1/3) + 1) / 6.5
    assert choose(cands, policy("default"), DEFAULTS, 0) == Choice(
        "http://b", pytest.approx((2.45 + 2 / 3) / 6.5)
    )


def test_a_cold_prompt_avoids_the_engine_still_prefilling_another_cold_prompt() -> None:
    # Equal request counts and prompt starts; a still owes 600 uncached prompt tokens, b none.
    # b: (0 + 0.5*0.9 + 1*(1 - 1/8) + 0 + 1*(1 - 0/600)) / 6.5; a scores the same less the backlog's 1.
    a = Candidate("http://a", load(kv=0.1), in_flight=1, prompt_blocks=4, prompt_starts=1, prefill_tokens=600)
    b = Candidate("http://b", load(kv=0.1), in_flight=1, prompt_blocks=4, prompt_starts=1)
    assert choose([a, b], policy("default"), DEFAULTS, 0) == Choice("http://b", pytest.approx(2.325 / 6.5))
    assert default_score(a, replace(DEFAULTS, max_prompt_starts=1, max_prefill_tokens=600)) == pytest.approx(
        1.325 / 6.5
    )


def test_a_repeat_follows_its_prompt_to_the_engine_still_prefilling_it() -> None:
    # a was sent this prompt and is still prefilling it; b is idle and was sent nothing.
    # a: (3*1 + 0.5*0.9 + 1*(1 - 1/8) + 0 + 0) / 6.5 = 4.325 / 6.5; b: (0 + 0.5 + 1 + 1 + 1) / 6.5 = 3.5 / 6.5
    a = Candidate("http://a", load(kv=0.1), in_flight=1, prefix_blocks=4, prompt_blocks=4, prompt_starts=1,
                  prefill_tokens=600)  # fmt: skip
    b = Candidate("http://b", load(), in_flight=0, prompt_blocks=4)
    assert choose([b, a], policy("default"), DEFAULTS, 0) == Choice("http://a", pytest.approx(4.325 / 6.5))


def test_equal_engines_share_requests_by_rotation() -> None:
    same = [Candidate(f"http://{n}", load(), in_flight=0) for n in "xyz"]
    picks = [choose(same, policy("default"), CTX, r) for r in range(3)]
    assert [p.url for p in picks if p] == ["http://x", "http://y", "http://z"]


def test_no_candidates_is_no_choice() -> None:
    assert choose([], policy("default"), CTX, 0) is None


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="unknown routing policy 'fastest'; known: adapter-aware, default, kv-aware"
    ):
        policy("fastest")


def test_saturation_is_a_full_queue_or_a_full_cache_with_waiters() -> None:
    assert is_saturated(Candidate("u", load(running=4, waiting=4), in_flight=0), CTX)
    assert not is_saturated(Candidate("u", load(running=4, waiting=3), in_flight=0), CTX)
    assert is_saturated(Candidate("u", load(), in_flight=8), CTX)
    assert is_saturated(Candidate("u", load(kv=0.96, running=1, waiting=1), in_flight=0), CTX)
    assert not is_saturated(Candidate("u", load(kv=0.96, running=2), in_flight=0), CTX)


def test_block_hashes_chain_over_full_chunks_only() -> None:
    a = block_hashes("abcdefgh-xy", 4)
    b = block_hashes("abcdefgZ", 4)
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes("efgh", 4)[0] != a[1], "a block's hash depends on what precedes it"
    assert block_hashes("abc", 4) == []


def test_the_prefix_index_counts_leading_blocks_per_engine() -> None:
    index = PrefixIndex(capacity=100)
    shared = block_hashes("S" * 32 + "one" * 8, 8)
    other = block_hashes("S" * 32 + "two" * 8, 8)
    index.record(shared, "http://a")
    assert index.matched_blocks(other, ["http://a", "http://b"]) == {"http://a": 4, "http://b": 0}
    assert index.matched_blocks(shared, ["http://a"]) == {"http://a": 7}
    index.forget("http://a")
    assert index.matched_blocks(shared, ["http://a"]) == {"http://a": 0} and len(index) == 0


def test_the_prefix_index_counts_each_engines_distinct_prompt_starts_while_they_are_kept() -> None:
    index = PrefixIndex(capacity=4)
    index.record([1, 2], "a")
    index.record([1, 3], "a")  # the same start again
    index.record([5], "a")
    assert index.prompt_starts("a") == 2 and index.prompt_starts("b") == 0
    index.record([6, 7], "b")  # LRU order was 2, 1, 3, 5: six entries, so 2 and then 1 (a start) go
    assert (index.prompt_starts("a"), index.prompt_starts("b")) == (1, 1)
    index.record([8], "b")  # evicts 3, not a start
    assert (index.prompt_starts("a"), index.prompt_starts("b")) == (1, 2)
    index.record([9], "c")  # evicts 5, a's last start
    assert index.prompt_starts("a") == 0
    index.forget("b")
    assert index.prompt_starts("b") == 0


def test_the_prefix_index_evicts_the_least_recently_recorded_blocks() -> None:
    index = PrefixIndex(capacity=3)
    index.record([1, 2], "a")
    index.record([3], "b")
    index.record([1], "b")  # touches 1
    index.record([4], "c")  # evicts 2
    assert index.matched_blocks([1, 2], ["a"]) == {"a": 1}
    assert index.matched_blocks([3], ["b"]) == {"b": 1}
    assert len(index) == 3


def test_prompt_text_of_chat_and_completion_requests() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    assert prompt_text(chat) == "system\nbe brief\nuser\nhi\n"
    assert prompt_text({"prompt": ["ab", "cd"]}) == "abcd"
    assert prompt_text({"prompt": "hello"}) == "hello"


def test_kv_aware_counts_tokens_sent_since_the_last_load_so_requests_do_not_herd() -> None:
    fresh = EngineLoad(model="m", kv_cache_usage=0.10, num_waiting=0, num_running=0, max_num_seqs=8,
                       num_kv_blocks=100, block_size=16)  # fmt: skip
    warm = fresh.model_copy(update={"kv_cache_usage": 0.05})
    a = Candidate("http://a", fresh, in_flight=0)
    b = Candidate("http://b", warm, in_flight=2, pending_tokens=160)  # 160 / 1600 = +0.10
    assert b.kv_usage == pytest.approx(0.15)
    assert choose([a, b], policy("kv-aware"), CTX, 0) == Choice("http://a", pytest.approx(0.9))


def test_the_same_prompt_in_two_namespaces_shares_no_prefix_block() -> None:
    text = "a shared system prompt " * 20
    plain, tenant_a, tenant_b = (block_hashes(text, 32, ns) for ns in ("", "tenant-a", "tenant-b"))
    assert len(plain) == len(tenant_a) == len(tenant_b) > 0
    assert not set(plain) & set(tenant_a) and not set(tenant_a) & set(tenant_b)
    assert block_hashes(text, 32, "tenant-a") == tenant_a
