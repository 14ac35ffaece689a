"""One request's deltas on the API side, in order, coalesced when the reader lags.

Where it sits: ``AsyncEngine`` pushes each :class:`~kvfleet.engine.outputs.ReqDelta` of a
step batch into the request's :class:`RequestStream`; the route iterates it with
``async for`` and gets the deltas as ``Engine.step()`` made them (new text, token ids and
logprobs per sequence), so the routes cannot tell a core process from a thread. Nothing
here rebuilds a cumulative output: the non-streamed response folds the deltas itself
(``CompletionOutput.add``). Each stream carries its request's :class:`RequestMetrics`, the
timeline ``AsyncEngine`` stamps and the server's Prometheus observer reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvfleet.engine.outputs import ReqDelta, SeqDelta


@dataclass
class RequestMetrics:
    """One request's timeline (``time.monotonic`` seconds; tokens stamped at the core's clock)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int = 0
    scheduled_time: float | None = None  # start of the step that produced the request's first output
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)  # one per token after the first
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for fewer than two tokens)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


def coalesce(deltas: list[ReqDelta]) -> ReqDelta:
    """Several deltas of one request as one: each sequence's news concatenated, the last flags kept."""
    if len(deltas) == 1:
        return deltas[0]
    seqs: dict[int, SeqDelta] = {}
    for d in deltas:
        for s in d.seqs:
            prev = seqs.get(s.choice)
            seqs[s.choice] = s if prev is None else _join(prev, s)
    return deltas[-1]._replace(seqs=[seqs[i] for i in sorted(seqs)])


def _join(a: SeqDelta, b: SeqDelta) -> SeqDelta:
    logprobs = None if a.new_logprobs is None else a.new_logprobs + (b.new_logprobs or [])
    return SeqDelta(
        b.choice,
        a.new_text + b.new_text,
        a.new_token_ids + b.new_token_ids,
        b.finish_reason,
        b.stop_reason,
        logprobs,
    )


class RequestStream:
    """The deltas of one request, in order; iterate with ``async for``.

    Invariant: every delta pushed is handed out exactly once, in order. When several are
    waiting as the reader comes back (a slow client), they come out as one (:func:`coalesce`),
    so a lagging stream costs one chunk, not one per token.
    """

    def __init__(self, request_id: str, metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.metrics = metrics
        self.finished = False
        self._pending: list[ReqDelta] = []
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()

    # -- fed by AsyncEngine on the event loop
    def push(self, delta: ReqDelta) -> None:
        self._pending.append(delta)
        self._wakeup.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wakeup.set()

    # -- read by the route
    def __aiter__(self) -> AsyncIterator[ReqDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ReqDelta]:
        while not self.finished:
            if not self._pending and self._error is None:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._pending:
                deltas, self._pending = self._pending, []
                delta = coalesce(deltas)
                self.finished = delta.finished
                yield delta
            elif self._error is not None:
                self.finished = True
                raise self._error
