"""RequestOutputKind: FINAL_ONLY requests give the same final outputs as PER_STEP ones, and only at the end."""

import dataclasses
from collections.abc import Callable

import pytest

from kvfleet.engine import LLM, RequestOutputKind, SamplingParams, SamplingParamsError
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.outputs import ReqDelta

from .conftest import EOS, fold

MakeEngine = Callable[..., Engine]

# Prompt, params: one request per stop condition (length, stop string, stop token, EOS, n > 1, logprobs).
REQUESTS: list[tuple[str, SamplingParams]] = [
    ("a", SamplingParams(max_tokens=6)),
    ("a", SamplingParams(max_tokens=20, stop=["def"])),
    ("x", SamplingParams(max_tokens=20, stop_token_ids=[ord("c")])),
    ("q", SamplingParams(max_tokens=9, n=2, logprobs=1)),
    ("abcdefgh", SamplingParams(max_tokens=3)),
]


def eos_after_f(last: int) -> int:
    return EOS if last == ord("f") else (ord("a") if last >= ord("z") else last + 1)


def run_steps(engine: Engine, kind: RequestOutputKind) -> list[list[ReqDelta]]:
    for i, (prompt, params) in enumerate(REQUESTS):
        engine.add_request(f"r{i}", prompt, dataclasses.replace(params, output_kind=kind))
    steps: list[list[ReqDelta]] = []
    while engine.has_unfinished_requests():
        assert len(steps) < 100, "engine did not finish within 100 steps"
        steps.append(engine.step())
    return steps


def finals(steps: list[list[ReqDelta]]) -> dict[str, tuple[object, ...]]:
    return {
        rid: (
            out.finished,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs],
        )
        for rid, out in fold(d for step in steps for d in step).items()
    }


def test_final_only_gives_the_per_step_final_outputs_and_nothing_before_them(make_engine: MakeEngine) -> None:
    per_step = run_steps(make_engine(next_token=eos_after_f), RequestOutputKind.PER_STEP)
    final_only = run_steps(make_engine(next_token=eos_after_f), RequestOutputKind.FINAL_ONLY)
    assert finals(final_only) == finals(per_step)
    assert {rid: v[1][0][1:4] for rid, v in finals(final_only).items()} == {  # type: ignore[index]
        "r0": ("bcdef", [98, 99, 100, 101, 102, EOS], "stop"),
        "r1": ("bc", [98, 99, 100, 101, 102], "stop"),
        "r2": ("yzab", [121, 122, 97, 98, 99], "stop"),
        "r3": ("rstuvwxyz", [114, 115, 116, 117, 118, 119, 120, 121, 122], "length"),
        "r4": ("ijk", [105, 106, 107], "length"),
    }
    # Each FINAL_ONLY request appears once, in the step PER_STEP marks it finished (r3: when its
    # second sample, forked a step after the first, ends).
    assert [[o.request_id for o in step] for step in final_only] == [
        [o.request_id for o in step if o.finished] for step in per_step
    ]
    assert [[o.request_id for o in step] for step in final_only] == [
        [],
        [],
        ["r4"],
        [],
        ["r1", "r2"],
        ["r0"],
        [],
        [],
        [],
        ["r3"],
    ]


def test_a_final_only_request_gets_one_delta_holding_the_whole_completion(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    steps = [engine.step() for _ in range(4)]
    assert [len(s) for s in steps] == [0, 0, 0, 1]
    out = steps[-1][0].seqs[0]
    assert (out.new_text, out.new_token_ids, out.finish_reason) == ("bcde", [98, 99, 100, 101], "length")
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0.0


def test_per_step_and_final_only_requests_share_a_step_each_with_its_own_kind(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    engine.add_request("stream", "a", SamplingParams(max_tokens=3))
    engine.add_request("final", "a", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY))
    steps = [[(o.request_id, o.seqs[0].new_text) for o in engine.step()] for _ in range(3)]
    assert steps == [[("stream", "b")], [("stream", "c")], [("stream", "d"), ("final", "bcd")]]


def test_an_aborted_final_only_request_still_returns_its_final_output(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", "a", SamplingParams(max_tokens=9, output_kind=RequestOutputKind.FINAL_ONLY))
    assert engine.step() == [] and engine.step() == []
    out = engine.abort("r")
    assert out is not None
    assert (out.finished, out.seqs[0].new_text, out.seqs[0].finish_reason) == (True, "bc", "abort")


# Multi-byte characters, a byte that starts none and a 4-byte lead cut short: the final-only text is
# decoded in one push at the end (output_processor's lazy text), the streamed one token by token.
UTF8_CHAIN = [0x68, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF, 0xF0, 0x41]


def utf8_chain(last: int) -> int:
    i = UTF8_CHAIN.index(last) if last in UTF8_CHAIN else -1
    return UTF8_CHAIN[(i + 1) % len(UTF8_CHAIN)]


def test_final_only_text_decoded_at_the_end_equals_the_streamed_text_byte_for_byte(
    make_engine: MakeEngine,
) -> None:
    texts: dict[RequestOutputKind, dict[str, tuple[str, str | None]]] = {}
    for kind in RequestOutputKind:
        engine = make_engine(next_token=utf8_chain, max_model_len=128)
        for n in range(1, 14):  # every cut through the chain, so some end inside a character
            engine.add_request(f"r{n}", "h", SamplingParams(max_tokens=n, output_kind=kind))
        engine.add_request("aborted", "h", SamplingParams(max_tokens=40, output_kind=kind))
        deltas = [engine.step() for _ in range(5)]
        deltas.append([d for d in [engine.abort("aborted")] if d is not None])
        while engine.has_unfinished_requests():
            deltas.append(engine.step())
        outs = fold(d for step in deltas for d in step)
        texts[kind] = {r: (o.outputs[0].text, o.outputs[0].finish_reason) for r, o in outs.items()}
    streamed = texts[RequestOutputKind.PER_STEP]
    assert texts[RequestOutputKind.FINAL_ONLY] == streamed
    assert streamed["r5"] == ("é€", "length") and streamed["r7"] == ("é€\ufffd\ufffd", "length")
    assert streamed["aborted"][1] == "abort"


def test_generate_runs_every_request_final_only_without_changing_the_callers_params(
    make_engine: MakeEngine,
) -> None:
    llm = LLM(engine=make_engine())
    seen: list[tuple[str, bool]] = []
    step = llm.engine.step

    def recording_step() -> list[ReqDelta]:
        outs = step()
        seen.extend((o.request_id, o.finished) for o in outs)
        return outs

    llm.engine.step = recording_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3)
    outs = llm.generate(["a", "x"], [params, SamplingParams(max_tokens=1)])
    assert [o.outputs[0].text for o in outs] == ["bcd", "y"]
    assert seen == [("llm-1", True), ("llm-0", True)]
    assert params.output_kind is RequestOutputKind.PER_STEP


def test_an_output_kind_that_is_not_a_request_output_kind_is_rejected_naming_the_choices() -> None:
    with pytest.raises(SamplingParamsError, match="output_kind: must be a RequestOutputKind") as exc:
        SamplingParams(output_kind="final_only")  # type: ignore[arg-type]
    assert exc.value.field == "output_kind"
    assert "PER_STEP, FINAL_ONLY" in str(exc.value) and "'final_only'" in str(exc.value)
