"""A request's stream hands out the core's deltas as they are, and merges the ones a slow reader left waiting."""

from __future__ import annotations

from kvfleet.engine.client.request_stream import RequestMetrics, RequestStream
from kvfleet.engine.outputs import ReqDelta, SeqDelta, TokenLogprob


def _delta(text: str, token: int, finish: str | None = None, logprob: float | None = None) -> ReqDelta:
    lps = None if logprob is None else [TokenLogprob(token, logprob)]
    return ReqDelta("r", finish is not None, 3, 0, [SeqDelta(0, text, [token], finish, None, lps)])


async def test_deltas_waiting_together_come_out_as_one_delta_with_their_concatenation() -> None:
    stream = RequestStream("r", RequestMetrics("r", 0.0))
    for text, token in (("a", 97), ("b", 98)):
        stream.push(_delta(text, token))
    stream.push(_delta("c", 99, finish="length"))
    outs = [out async for out in stream]
    assert len(outs) == 1
    s = outs[0].seqs[0]
    assert (s.new_text, s.new_token_ids, s.finish_reason) == ("abc", [97, 98, 99], "length")
    assert (outs[0].finished, outs[0].num_prompt_tokens, stream.finished) == (True, 3, True)


async def test_a_reader_that_keeps_up_gets_each_delta_as_the_core_sent_it() -> None:
    stream = RequestStream("r", RequestMetrics("r", 0.0))
    it = aiter(stream)
    first_delta = _delta("a", 97, logprob=-0.5)
    stream.push(first_delta)
    assert await anext(it) is first_delta  # nothing rebuilt on the way
    stream.push(_delta("b", 98, finish="stop", logprob=-1.5))
    second = (await anext(it)).seqs[0]
    assert (second.new_text, second.finish_reason, second.new_logprobs) == (
        "b",
        "stop",
        [TokenLogprob(98, -1.5)],
    )


async def test_merged_sequences_keep_their_own_news_and_order() -> None:
    stream = RequestStream("r", RequestMetrics("r", 0.0))
    stream.push(ReqDelta("r", False, 3, 0, [SeqDelta(0, "a", [97], None, None, None)]))
    stream.push(ReqDelta("r", False, 3, 0, [SeqDelta(1, "x", [120], None, None, None)]))
    stream.push(ReqDelta("r", True, 3, 0, [SeqDelta(0, "b", [98], "length", None, None)]))
    (out,) = [d async for d in stream]
    assert [(s.choice, s.new_text, s.finish_reason) for s in out.seqs] == [
        (0, "ab", "length"),
        (1, "x", None),
    ]
