"""A request's stream rebuilds the cumulative output from the core's deltas and merges the ones a slow reader left waiting."""

from __future__ import annotations

from kvfleet.engine.async_engine import RequestMetrics
from kvfleet.engine.core import ReqDelta, SeqDelta
from kvfleet.engine.outputs import TokenLogprob
from kvfleet.engine.request_stream import RequestStream


def _delta(text: str, token: int, finish: str | None = None, logprob: float | None = None) -> ReqDelta:
    lps = None if logprob is None else [TokenLogprob(token, logprob)]
    return ReqDelta("r", finish is not None, 3, 0, [SeqDelta(0, text, [token], finish, None, lps)])


async def test_deltas_waiting_together_come_out_as_one_output_with_their_concatenation() -> None:
    stream = RequestStream("r", RequestMetrics("r", 0.0), n=1, prompt=[1, 2, 3])
    for text, token in (("a", 97), ("b", 98)):
        stream.push(_delta(text, token))
    stream.push(_delta("c", 99, finish="length"))
    outs = [out async for out in stream]
    assert len(outs) == 1
    c = outs[0].outputs[0]
    assert (c.new_text, c.new_token_ids, c.text, c.token_ids, c.finish_reason) == (
        "abc",
        [97, 98, 99],
        "abc",
        [97, 98, 99],
        "length",
    )
    assert (outs[0].finished, outs[0].prompt_token_ids, stream.finished) == (True, [1, 2, 3], True)


async def test_a_reader_that_keeps_up_gets_one_output_per_delta_with_cumulative_text_and_logprobs() -> None:
    stream = RequestStream("r", RequestMetrics("r", 0.0), n=1)
    it = aiter(stream)
    stream.push(_delta("a", 97, logprob=-0.5))
    first = (await anext(it)).outputs[0]
    stream.push(_delta("b", 98, finish="stop", logprob=-1.5))
    second = (await anext(it)).outputs[0]
    assert (first.new_text, first.text, first.logprobs) == ("a", "a", [TokenLogprob(97, -0.5)])
    assert (second.new_text, second.text, second.finish_reason) == ("b", "ab", "stop")
    assert second.logprobs == [TokenLogprob(97, -0.5), TokenLogprob(98, -1.5)]
