"""The benchmark client's maths and its streaming, on known inputs and a fake clock (no server)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvfleet.bench.dists import Distribution, DistributionError, parse_distribution
from kvfleet.bench.load import (
    LoadSpec,
    arrival_offsets,
    new_session,
    plan_requests,
    request_body,
    run_load,
    stream_one,
)
from kvfleet.bench.stats import Percentiles, RequestRecord, format_summary, percentile, summarize
from kvfleet.sse import SseReader


def test_distributions_parse_from_their_flag_syntax() -> None:
    assert parse_distribution("fixed:128") == Distribution("fixed", 128)
    assert parse_distribution("uniform:10:20") == Distribution("uniform", 10, 20)
    assert parse_distribution("lognormal:100:0.5") == Distribution("lognormal", 100, 0.5)
    assert str(parse_distribution("uniform:10:20")) == "uniform:10:20"
    for bad in ("fixed:0", "uniform:5:2", "normal:1:2", "fixed:x", "lognormal:100"):
        with pytest.raises(DistributionError, match="expected fixed:N|must be numbers"):
            parse_distribution(bad)


def test_draws_are_reproducible_and_within_their_bounds() -> None:
    assert [Distribution("fixed", 7).sample(random.Random(0)) for _ in range(3)] == [7, 7, 7]
    rng, ref = random.Random(5), random.Random(5)
    assert [Distribution("uniform", 3, 9).sample(rng) for _ in range(20)] == [
        ref.randint(3, 9) for _ in range(20)
    ]
    # sigma 0: every draw is the mean itself.
    assert {Distribution("lognormal", 50, 0).sample(random.Random(1)) for _ in range(5)} == {50}


def test_percentiles_interpolate_between_ranks_as_numpy_does() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.5
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert Percentiles.of([2.0]) == Percentiles(2.0, 2.0, 2.0, 2.0)
    assert Percentiles.of([]) is None


def test_the_summary_counts_throughput_goodput_and_errors_exactly() -> None:
    records = [
        RequestRecord(
            ok=True, ttft=0.1, e2e=1.1, itls=[0.25] * 4, prompt_tokens=10, output_tokens=5
        ),  # tpot 0.25
        RequestRecord(
            ok=True, ttft=0.5, e2e=0.9, itls=[0.1] * 4, prompt_tokens=10, output_tokens=5
        ),  # tpot 0.1
        RequestRecord(ok=False, error="HTTP 429 rate_limited"),
    ]
    s = summarize(records, duration_s=2.0, slo_ttft_s=0.2, slo_tpot_s=0.3)
    assert (s.num_requests, s.num_ok, s.num_failed) == (3, 2, 1)
    assert (s.request_throughput, s.output_token_throughput, s.total_token_throughput) == (1.0, 5.0, 15.0)
    assert s.ttft is not None
    assert (s.ttft.mean, s.ttft.p50, s.ttft.p90, s.ttft.p99) == pytest.approx((0.3, 0.3, 0.46, 0.496))
    assert s.tpot is not None and (s.tpot.mean, s.tpot.p50) == (pytest.approx(0.175), pytest.approx(0.175))
    assert s.itl is not None and s.itl.p50 == pytest.approx(0.175)
    # Only the first meets TTFT <= 200 ms; the failure counts against attainment.
    assert (s.goodput, s.slo_attainment) == (0.5, pytest.approx(1 / 3))
    assert s.errors == {"HTTP 429 rate_limited": 1}
    assert "goodput: 0.50 req/s (33.3 % of requests met the SLOs)" in format_summary(s)


def test_a_single_token_request_has_no_tpot_and_meets_the_tpot_slo() -> None:
    s = summarize([RequestRecord(ok=True, ttft=0.1, e2e=0.1, output_tokens=1)], 1.0, slo_tpot_s=0.001)
    assert (s.tpot, s.goodput) == (None, 1.0)


def _sse(*payloads: object) -> bytes:
    return b"".join(f"data: {json.dumps(p) if not isinstance(p, str) else p}\n\n".encode() for p in payloads)


def _chunk(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _ticks() -> Iterator[float]:
    return (float(t) for t in itertools.count())


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """A real HTTP server on 127.0.0.1 answering every path with ``handler``, and a session for it."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with new_session() as session:
            yield str(server.make_url("")).rstrip("/"), session
    finally:
        await server.close()


def _replies(status: int, body: bytes, pieces: int = 1) -> Handler:
    """A handler that answers ``body`` cut into ``pieces`` writes (so events straddle network reads)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        step = max(1, len(body) // pieces)
        for i in range(0, len(body), step):
            await resp.write(body[i : i + step])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    return handler


async def test_one_streamed_request_is_timed_chunk_by_chunk_and_counted_from_usage() -> None:
    body = _sse(
        _chunk("a"),
        _chunk(""),
        _chunk("b"),
        _chunk("c"),
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}},
        "[DONE]",
    )
    clock = _ticks()
    async with _server(_replies(200, body, pieces=7)) as (url, session):
        r = await stream_one(session, LoadSpec(url=url), {"model": "m"}, 4, lambda: next(clock))
    # The clock reads 0 at the send, then once per content chunk, then once at the end.
    assert (r.ok, r.ttft, r.itls, r.e2e) == (True, 1.0, [1.0, 1.0], 4.0)
    assert (r.prompt_tokens, r.output_tokens, r.tpot) == (9, 3, 1.5)


async def test_without_usage_the_tokens_are_the_content_chunks_and_http_errors_are_recorded() -> None:
    chat = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    clock = _ticks()
    async with _server(_replies(200, _sse(chat, chat, "[DONE]"))) as (url, session):
        r = await stream_one(session, LoadSpec(url=url, endpoint="chat"), {}, 7, lambda: next(clock))
    assert (r.output_tokens, r.prompt_tokens) == (2, 7)
    refused = json.dumps({"error": {"code": "rate_limited"}}).encode()
    async with _server(_replies(429, refused)) as (url, session):
        r = await stream_one(session, LoadSpec(url=url), {}, 7, lambda: 0.0)
    assert (r.ok, r.error) == (False, "HTTP 429 rate_limited")
    async with _server(_replies(502, b"<html>bad gateway</html>")) as (url, session):
        r = await stream_one(session, LoadSpec(url=url), {}, 7, lambda: 0.0)
    assert (r.ok, r.error) == (False, "HTTP 502")


async def test_an_error_event_mid_stream_fails_the_request_with_its_code() -> None:
    vllm_flat = {"object": "error", "message": "boom", "type": "InternalServerError", "code": 500}
    for event, detail in (
        ({"error": {"type": "engine_dead", "message": "x"}}, "engine_dead"),
        (vllm_flat, "500"),
    ):
        async with _server(_replies(200, _sse(_chunk("a"), event, "[DONE]"))) as (url, session):
            r = await stream_one(session, LoadSpec(url=url), {}, 3, lambda: 0.0)
        assert (r.ok, r.error, r.ttft) == (False, f"stream error {detail}", 0.0)


def test_the_sse_reader_returns_every_event_once_however_the_bytes_are_cut() -> None:
    stream = b'data: {"a": 1}\r\n\r\n: ping\n\nevent: x\ndata: one\ndata: two\n\ndata:[DONE]\n\n'
    expected = [b'{"a": 1}', b"one\ntwo", b"[DONE]"]
    for cut in range(1, len(stream)):
        reader = SseReader()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == expected, cut
    reader = SseReader()
    assert [p for i in range(len(stream)) for p in reader.feed(stream[i : i + 1])] == expected


def test_poisson_arrivals_are_exponential_gaps_from_the_seed() -> None:
    assert arrival_offsets(3, None, random.Random(0)) == [0.0, 0.0, 0.0]
    ref = random.Random(3)
    gaps = [ref.expovariate(2.0) for _ in range(3)]
    assert arrival_offsets(4, 2.0, random.Random(3)) == pytest.approx(
        [0.0, gaps[0], gaps[0] + gaps[1], sum(gaps)]
    )


def test_a_shared_prefix_is_the_same_leading_tokens_in_every_prompt() -> None:
    spec = LoadSpec(url="http://x", num_requests=4, input_len=Distribution("fixed", 10), shared_prefix=0.5)
    planned = plan_requests(spec, random.Random(0))
    assert [p.prompt_len for p in planned] == [10] * 4
    prompts = [p.prompt for p in planned]
    assert all(isinstance(p, list) and len(p) == 10 for p in prompts)
    assert len({tuple(p[:5]) for p in prompts}) == 1  # type: ignore[index]
    assert len({tuple(p[5:]) for p in prompts}) == 4  # type: ignore[index]


def test_the_request_body_uses_only_standard_openai_fields() -> None:
    spec = LoadSpec(url="http://x/v1", endpoint="chat")
    p = plan_requests(spec, random.Random(0))[0]
    body = request_body(spec, "m", p)
    assert set(body) == {"model", "max_tokens", "temperature", "stream", "stream_options", "messages"}
    assert spec.base_url == "http://x"


async def test_the_closed_loop_never_has_more_than_concurrency_requests_in_flight() -> None:
    in_flight, peak = 0, 0

    reply = _replies(200, _sse(_chunk("x"), "[DONE]"))

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return await reply(request)

    async with _server(handler) as (url, session):
        spec = LoadSpec(url=url, model="m", num_requests=12, concurrency=3)
        result = await run_load(spec, session=session)
    assert (peak, len(result.records), sum(r.ok for r in result.records)) == (3, 12, 12)


def test_a_spec_with_both_loops_or_bad_ranges_is_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        LoadSpec(url="http://x", rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="shared_prefix must be in"):
        LoadSpec(url="http://x", shared_prefix=1.5)
