"""A small multi-tenant streaming load that says what became of every request: the fault suite's yardstick.

Where it sits: the fault scenarios (:mod:`kvfleet.testing.faults`), their e2e tests
(``e2e/test_faults.py``) and bench (``bench/router/faults.py``), and the overload goodput figure
(``bench/router/router_overload.py``) drive a fleet with :func:`run_load` while something breaks,
then read the :class:`Tally`. Each request streams a completion (``ignore_eos``, so the
length is known) with the usage chunk, under a hard bound, and ends as exactly one of:

- ``completed``: a 200 stream with every token asked for, a finish reason, the usage chunk
  and ``data: [DONE]`` last;
- ``clean_error``: an OpenAI error body (``{"error": {"message", "type", "param", "code"}}``)
  with a non-200 status, or a 200 stream ending with such an error event (then ``[DONE]``
  or a clean close);
- ``refused``: the connection was refused before any byte was sent, or reset before any
  byte of a response came back (nothing was accepted: the router was down, or stopping and
  closed its listener over connections it had not yet taken; the official client retries
  both), so it is not counted as accepted;
- ``lost``: anything else: a hang past the bound, a stream that stops short yet looks
  finished, an error body of another shape, a connection that broke with no terminal event.

The fault suite's promise is ``lost == 0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import aiohttp
import orjson

from kvfleet.bench.stats import RequestRecord
from kvfleet.sse import DONE, SseReader

Kind = Literal["completed", "clean_error", "refused", "lost"]
ERROR_FIELDS = ("message", "type", "param", "code")


class Tenant(NamedTuple):
    name: str
    key: str


class Outcome(NamedTuple):
    tenant: str
    kind: Kind
    detail: str  # the error code of a clean error, why a request is lost, "" when completed
    status: int | None  # the HTTP status; None when no response came
    start: float  # perf_counter
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0

    def record(self) -> RequestRecord:
        """As the bench summary reads it (goodput, TTFT percentiles)."""
        ok = self.kind == "completed"
        return RequestRecord(
            ok,
            self.start,
            self.ttft,
            self.e2e,
            [],
            self.prompt_tokens,
            self.output_tokens,
            None if ok else f"{self.kind}: {self.detail}",
        )


@dataclass
class Tally:
    """The counts of one run: accepted = answered by the server (every kind but ``refused``)."""

    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, kind: Kind) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    @property
    def accepted(self) -> int:
        return len(self.outcomes) - self.count("refused")

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "lost"]

    def error_codes(self) -> dict[str, int]:
        codes: dict[str, int] = {}
        for o in self.outcomes:
            if o.kind == "clean_error":
                codes[o.detail] = codes.get(o.detail, 0) + 1
        return codes

    def tokens(self, tenant: str | None = None) -> int:
        """Prompt + completion tokens of the completed requests (of ``tenant``)."""
        done = [o for o in self.outcomes if o.kind == "completed" and tenant in (None, o.tenant)]
        return sum(o.prompt_tokens + o.output_tokens for o in done)


def is_openai_error(obj: Any) -> bool:
    """``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``."""
    err = obj.get("error") if isinstance(obj, dict) else None
    return (
        isinstance(err, dict)
        and all(k in err for k in ERROR_FIELDS)
        and isinstance(err["message"], str)
        and isinstance(err["type"], str)
    )


@dataclass
class _Stream:
    """What one streamed answer showed so far."""

    tokens: int = 0
    prompt_tokens: int = 0
    finished: bool = False  # a choice carried a finish_reason
    usage: bool = False
    done: bool = False  # data: [DONE] arrived
    error: str | None = None  # the code of a well-shaped error event
    bad: str | None = None  # why the stream is malformed
    first_at: float | None = None

    def take(self, payload: bytes) -> None:
        if payload == DONE:
            self.done = True
            return
        if self.done:
            self.bad = "an event after [DONE]"
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.bad = f"an event that is not JSON: {payload[:80]!r}"
            return
        if isinstance(obj, dict) and "error" in obj:
            if is_openai_error(obj):
                self.error = str(obj["error"]["code"])
            else:
                self.bad = f"an error event of another shape: {payload[:200]!r}"
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = True
            self.tokens = int(obj["usage"].get("completion_tokens") or 0)
            self.prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
        for choice in obj.get("choices") or [] if isinstance(obj, dict) else []:
            if self.first_at is None:
                self.first_at = time.perf_counter()
            if choice.get("finish_reason"):
                self.finished = True

    def verdict(self, max_tokens: int, closed_cleanly: bool) -> tuple[Kind, str]:
        if self.bad is not None:
            return "lost", self.bad
        if self.error is not None:
            return (
                ("clean_error", self.error)
                if self.done or closed_cleanly
                else ("lost", "error event, then a broken connection")
            )
        if not self.done:
            return "lost", "the stream ended without [DONE] or an error event"
        if not (self.finished and self.usage and self.tokens == max_tokens):
            why = f"{self.tokens} of {max_tokens} tokens, finish_reason={self.finished}, usage={self.usage}"
            return "lost", f"a truncated stream that looks finished ({why})"
        return "completed", ""


def completion_body(model: str, max_tokens: int, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }


async def one_request(
    session: aiohttp.ClientSession, url: str, tenant: Tenant, body: dict[str, Any], bound_s: float
) -> Outcome:
    """Stream one completion through ``url`` and classify how it ended (never raises)."""
    start, seen, status = time.perf_counter(), _Stream(), None
    headers = {"Authorization": f"Bearer {tenant.key}"}

    def out(kind: Kind, detail: str) -> Outcome:
        ttft = None if seen.first_at is None else seen.first_at - start
        return Outcome(
            tenant.name,
            kind,
            detail,
            status,
            start,
            ttft,
            time.perf_counter() - start,
            seen.tokens,
            seen.prompt_tokens,
        )

    try:
        async with asyncio.timeout(bound_s):
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                status = r.status
                if r.status != 200:
                    raw = await r.read()
                    with contextlib.suppress(orjson.JSONDecodeError):
                        obj = orjson.loads(raw)
                        if is_openai_error(obj):
                            return out("clean_error", str(obj["error"]["code"]))
                    return out("lost", f"a {r.status} that is not an OpenAI error: {raw[:200]!r}")
                reader = SseReader()
                try:
                    async for chunk in r.content.iter_any():
                        for payload in reader.feed(chunk):
                            seen.take(payload)
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    return out(*seen.verdict(int(body["max_tokens"]), closed_cleanly=False))
                return out(*seen.verdict(int(body["max_tokens"]), closed_cleanly=True))
    except TimeoutError:
        return out("lost", f"no end within {bound_s:.0f} s")
    except aiohttp.ClientConnectorError as exc:
        if status is None and isinstance(exc.os_error, ConnectionRefusedError):
            return out("refused", "connection refused")
        return out("lost", f"{type(exc).__name__}: {exc}")
    except aiohttp.ClientOSError as exc:
        if status is None and exc.errno == errno.ECONNRESET:
            return out("refused", "connection reset before any response")
        return out("lost", f"{type(exc).__name__}: {exc}")
    except aiohttp.ClientError as exc:
        return out("lost", f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class LoadSpec:
    """``requests`` streamed completions spread over ``tenants`` (round robin) and ``urls`` (round robin):
    closed loop with ``concurrency`` clients, or open loop at ``rate`` per second (Poisson)."""

    urls: Sequence[str]
    tenants: Sequence[Tenant]
    requests: int = 40
    concurrency: int = 6
    rate: float | None = None
    max_tokens: int = 24
    model: str = "tiny"
    bound_s: float = 60.0  # a request with no end by then is lost
    seed: int = 0

    def body(self, i: int) -> dict[str, Any]:
        return completion_body(
            self.model, self.max_tokens, f"request {i} of the fault load: " + "lorem ipsum " * 6
        )


async def run_load(
    spec: LoadSpec,
    on_outcome: Callable[[Outcome], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> Tally:
    """The requests of ``spec`` sent and classified (closed loop: until ``should_stop()``); ``on_outcome`` sees each.

    Each request has its own connection: a keep-alive connection the server closes as a new
    request goes out would be a loss of the client's making, not of the fault's.
    """
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=None, connect=5.0)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def send(i: int) -> None:
            tenant, url = spec.tenants[i % len(spec.tenants)], spec.urls[i % len(spec.urls)]
            outcome = await one_request(session, url, tenant, spec.body(i), spec.bound_s)
            tally.outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)

        if spec.rate is not None:
            rng, t, tasks = random.Random(spec.seed), time.perf_counter(), []
            for i in range(spec.requests):
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                tasks.append(asyncio.create_task(send(i)))
                t += rng.expovariate(spec.rate)
            await asyncio.gather(*tasks)
        else:
            numbers = iter(range(spec.requests))

            async def client() -> None:
                for i in numbers:
                    if should_stop():
                        return
                    await send(i)

            await asyncio.gather(*(client() for _ in range(spec.concurrency)))
    return tally


class BackgroundLoad:
    """:func:`run_load` in a thread of its own, so a test can break things meanwhile; ``done`` counts ended requests."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.done = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._result: Tally | BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        def count(_: Outcome) -> None:
            self.done += 1

        try:
            self._result = asyncio.run(run_load(self.spec, count, self._stop.is_set))
        except BaseException as exc:  # handed to the caller of result()
            self._result = exc

    def wait_for(self, done: int, limit_s: float = 60.0) -> None:
        """Until ``done`` requests have ended (bounded)."""
        deadline = time.monotonic() + limit_s
        while self.done < done and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)

    def result(self, limit_s: float = 180.0, stop: bool = False) -> Tally:
        """The tally once the load ends (``stop``: no new request starts; those under way finish)."""
        if stop:
            self._stop.set()
        self._thread.join(limit_s)
        if self._thread.is_alive():
            raise AssertionError(f"the load did not end within {limit_s:.0f} s")
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return self._result
