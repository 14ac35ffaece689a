"""One request's outputs on the API side, rebuilt from the core's deltas, coalesced when the reader lags.

Where it sits: ``AsyncEngine`` pushes each :class:`~kvfleet.engine.core.ReqDelta` of a
step batch into the request's :class:`RequestStream`; the route iterates it with
``async for`` and gets :class:`~kvfleet.engine.outputs.RequestOutput` values shaped as
``Engine.step()`` makes them (cumulative ``text`` / ``token_ids`` / ``logprobs`` plus
``new_text`` / ``new_token_ids``), so the routes cannot tell a core process from a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfleet.engine.core import ReqDelta
from kvfleet.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from kvfleet.engine.async_engine import RequestMetrics


@dataclass
class _Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestStream:
    """The outputs of one request, in order; iterate with ``async for``.

    Invariant: every delta pushed is applied exactly once, in order. When several are
    waiting as the reader comes back (a slow client), they merge into one output whose
    ``new_text`` / ``new_token_ids`` are their concatenation, so a lagging stream costs one
    chunk, not one per token.
    """

    def __init__(self, request_id: str, metrics: RequestMetrics, n: int, prompt: Any = None) -> None:
        self.request_id = request_id
        self.metrics = metrics
        self.finished = False
        self._prompt_ids: list[int] = prompt if isinstance(prompt, list) else []
        self._choices = [_Choice(i) for i in range(n)]
        self._pending: list[ReqDelta] = []
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._num_cached = 0

    # -- fed by AsyncEngine on the event loop
    def push(self, delta: ReqDelta) -> None:
        self._pending.append(delta)
        self._wakeup.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wakeup.set()

    # -- read by the route
    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            if not self._pending and self._error is None:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._pending:
                deltas, self._pending = self._pending, []
                yield self._apply(deltas)
            elif self._error is not None:
                self.finished = True
                raise self._error

    def _apply(self, deltas: list[ReqDelta]) -> RequestOutput:
        new_text: dict[int, list[str]] = {}
        new_ids: dict[int, list[int]] = {}
        for d in deltas:
            self._num_cached = d.num_cached_tokens
            for s in d.seqs:
                c = self._choices[s.choice]
                if s.new_text:
                    new_text.setdefault(s.choice, []).append(s.new_text)
                if s.new_token_ids:
                    new_ids.setdefault(s.choice, []).extend(s.new_token_ids)
                    c.token_ids.extend(s.new_token_ids)
                if s.new_logprobs is not None:
                    c.logprobs = (c.logprobs or []) + s.new_logprobs
                c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason
            if d.finished:
                self.finished = True
        outputs = []
        for c in self._choices:
            added = "".join(new_text.get(c.index, ()))
            c.text += added
            outputs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=None if c.logprobs is None else list(c.logprobs),
                    new_text=added,
                    new_token_ids=new_ids.get(c.index, []),
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self._prompt_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self._num_cached,
        )
