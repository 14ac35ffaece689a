"""Engine.step() with a deterministic fake runner: stop conditions, n > 1, bad input, stats, abort."""

from collections.abc import Callable
from typing import Any

import pytest

from kvfleet.engine.core.engine import Engine, EngineStats, RequestError
from kvfleet.engine.outputs import CompletionOutput, ReqDelta
from kvfleet.engine.sampling_params import SamplingParams

from .conftest import EOS, fold

MakeEngine = Callable[..., Engine]


def run(engine: Engine) -> list[ReqDelta]:
    updates: list[ReqDelta] = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return updates
        updates.extend(engine.step())
    raise AssertionError("engine did not finish within 200 steps")


def final(engine: Engine, request_id: str = "r") -> CompletionOutput:
    """Run to the end; the request's first sequence, folded from its deltas."""
    return fold(run(engine))[request_id].outputs[0]


def test_greedy_output_follows_the_runner_until_max_tokens(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=5))
    updates = run(engine)
    assert [u.seqs[0].new_text for u in updates] == ["b", "c", "d", "e", "f"]
    assert [u.seqs[0].new_token_ids for u in updates] == [[98], [99], [100], [101], [102]]
    out = fold(updates)["r"].outputs[0]
    assert (out.text, out.token_ids) == ("bcdef", [98, 99, 100, 101, 102])
    assert (out.finish_reason, updates[-1].finished, updates[-1].num_prompt_tokens) == ("length", True, 1)


def test_a_stop_string_ends_the_text_before_it_and_held_back_text_is_never_retracted(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=20, stop=["def", "xyz"]))
    updates = run(engine)
    assert [u.seqs[0].new_text for u in updates] == ["b", "c", "", "", ""]
    out = fold(updates)["r"].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("bc", "stop", "def")
    assert out.token_ids == [98, 99, 100, 101, 102]


def test_include_stop_str_in_output_keeps_the_stop_string(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=20, stop=["de"], include_stop_str_in_output=True))
    out = final(engine)
    assert (out.text, out.stop_reason) == ("bcde", "de")


def test_a_stop_token_id_ends_the_sequence_and_stays_in_the_token_ids(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=20, stop_token_ids=[ord("d")]))
    out = final(engine)
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("bc", [98, 99, 100], "stop", 100)


def eos_after_c(last: int) -> int:
    return EOS if last == ord("c") else (ord("a") if last == EOS else last + 1)


def test_eos_stops_unless_ignored_and_min_tokens_defers_it(make_engine: MakeEngine) -> None:
    engine = make_engine(next_token=eos_after_c)
    engine.add_request("eos", "a", SamplingParams(max_tokens=6))
    engine.add_request("ign", "a", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("min", "a", SamplingParams(max_tokens=6, min_tokens=4, stop=["b"]))
    finals = {rid: out.outputs[0] for rid, out in fold(run(engine)).items()}
    assert (finals["eos"].token_ids, finals["eos"].text, finals["eos"].finish_reason) == (
        [98, 99, EOS],
        "bc",
        "stop",
    )
    assert (finals["ign"].token_ids, finals["ign"].finish_reason) == ([98, 99, EOS, 97, 98, 99], "length")
    assert finals["ign"].text == "bcabc"
    # min_tokens=4: neither EOS (3rd token) nor the stop string 'b' in the first 4 tokens ends it
    assert (finals["min"].token_ids, finals["min"].text) == ([98, 99, EOS, 97, 98], "bca")
    assert (finals["min"].finish_reason, finals["min"].stop_reason) == ("stop", "b")


def test_a_sequence_reaching_max_model_len_finishes_with_length(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=8)
    engine.add_request("r", "aaaaa", SamplingParams(max_tokens=100))
    out = final(engine)
    assert (out.text, out.finish_reason) == ("bcd", "length")  # 5 + 3 = 8 tokens


def test_logprobs_are_collected_per_token_when_asked(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=2, logprobs=1))
    out = final(engine)
    assert out.logprobs is not None
    assert [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs] == [
        (98, -0.25, ((98, -0.25),)),
        (99, -0.25, ((99, -0.25),)),
    ]


def test_n_samples_share_the_prompt_blocks_and_compute_the_prompt_once(make_engine: MakeEngine) -> None:
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("r", "abcdefghij", SamplingParams(n=3, max_tokens=2))
    done = fold(run(engine))["r"]
    assert [o.index for o in done.outputs] == [0, 1, 2]
    assert [o.text for o in done.outputs] == ["kl", "kl", "kl"]
    steps = engine.runner.steps  # type: ignore[attr-defined]
    assert [(e.index, e.start, e.num_new, e.block_ids) for e in steps[0]] == [(0, 0, 10, (0, 1, 2))]
    assert [(e.index, e.start, e.num_new, e.block_ids) for e in steps[1]] == [
        (0, 10, 1, (0, 1, 2)),
        (1, 8, 2, (0, 1, 3)),
        (2, 8, 2, (0, 1, 4)),
    ]
    assert engine.stats().kv_cache_usage == 0.0


def bad_requests() -> list[tuple[Any, Any, str, str]]:
    return [
        ("", SamplingParams(), "prompt", "must not be empty"),
        ([], SamplingParams(), "prompt", "must not be empty"),
        ("a" * 65, SamplingParams(), "prompt", "65 tokens, more than max_model_len=64"),
        (
            [97, 300],
            SamplingParams(),
            "prompt",
            r"token id 300 at position 1 is outside the vocabulary \[0, 259\)",
        ),
        ("a", {"max_tokens": 3}, "params", "must be a SamplingParams, got dict"),
    ]


@pytest.mark.parametrize(("prompt", "params", "field", "message"), bad_requests())
def test_bad_input_names_the_field_and_leaves_the_engine_usable(
    make_engine: MakeEngine, prompt: Any, params: Any, field: str, message: str
) -> None:
    engine = make_engine()
    engine.add_request("ok-before", "a", SamplingParams(max_tokens=3))
    first = engine.step()
    with pytest.raises(RequestError, match=message) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.field == field
    engine.add_request("ok-after", "x", SamplingParams(max_tokens=2))
    finals = {rid: out.outputs[0].text for rid, out in fold(first + run(engine)).items()}
    assert finals == {"ok-before": "bcd", "ok-after": "yz"}
    assert engine.stats().kv_cache_usage == 0.0 and engine.stats().num_waiting == 0


def test_a_prompt_larger_than_the_whole_kv_cache_is_rejected_with_both_sizes(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=2)
    with pytest.raises(
        RequestError, match="9 tokens and needs 3 KV blocks; the KV cache holds 2 blocks of 4"
    ):
        engine.add_request("r", "a" * 9, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_a_duplicate_request_id_is_rejected_and_the_first_request_keeps_running(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="'r' is already in use") as err:
        engine.add_request("r", "x", SamplingParams())
    assert err.value.field == "request_id"
    assert final(engine).text == "bc"


def test_abort_frees_the_blocks_and_reports_abort(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "abcdefgh", SamplingParams(max_tokens=50, n=2))
    engine.step()
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    last = engine.abort("r")
    assert last is not None and last.finished
    assert [(s.choice, s.finish_reason) for s in last.seqs] == [(0, "abort"), (1, "abort")]
    assert engine.abort("r") is None
    assert (engine.stats().kv_cache_usage, engine.has_unfinished_requests()) == (0.0, False)
    assert engine.step() == []


def test_stats_count_tokens_prefix_hits_and_preemptions(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=4, max_num_seqs=4)  # 3 blocks each, 1 shared: 5 > 4
    engine.add_request("a", "abcdefg", SamplingParams(max_tokens=4), arrival_time=0.0)
    engine.add_request("b", "abcdefg", SamplingParams(max_tokens=4), arrival_time=1.0)
    run(engine)
    assert engine.stats() == EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_kv_blocks=4,
        max_num_seqs=4,
        prefix_cache_queries=7 + 7 + 9,  # a, b, then b again after its preemption (7 prompt + 2 output)
        # b shares a's first block in the step that computes it (4), and its recompute finds
        # a's two full blocks (same prompt, same outputs: 8)
        prefix_cache_hits=4 + 8,
        num_preemptions=1,
        prompt_tokens_total=14,
        generation_tokens_total=8,
        num_requests_finished=2,
    )


def test_streamed_text_never_splits_a_utf8_character(make_engine: MakeEngine) -> None:
    script = dict(zip([97, 0xC3, 0xA9, 0xE2, 0x82], [0xC3, 0xA9, 0xE2, 0x82, 0xAC], strict=True))  # a → é → €
    engine = make_engine(next_token=lambda last: script.get(last, 98))
    engine.add_request("r", "a", SamplingParams(max_tokens=6))
    updates = run(engine)
    assert [u.seqs[0].new_text for u in updates] == ["", "é", "", "", "€", "b"]
    assert fold(updates)["r"].outputs[0].text == "é€b"


def test_an_engine_given_a_runner_without_a_tokenizer_is_refused(make_engine: MakeEngine) -> None:
    from kvfleet.engine.config import EngineConfig

    from .conftest import FakeRunner

    with pytest.raises(ValueError, match="pass both runner and tokenizer, or neither"):
        Engine(EngineConfig(), FakeRunner())
