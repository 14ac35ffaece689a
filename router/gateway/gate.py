"""What the ext_proc server asks of the router: the small interface between Envoy and the request path.

The ext_proc layer (:mod:`kvfleet.router.gateway.extproc`) only translates Envoy's
messages; every decision is the router's, behind :class:`Gate`:

- :meth:`Gate.admit` sees the request's headers and whole body once and answers a
  :class:`Reply` (Envoy answers the client itself: a 401/403/404/429 with
  ``Retry-After``, before any upstream work) or an :class:`Admitted` request, which
  names its model, the engine (``host:port``) and the ones to fall back on when that
  one cannot be connected, and may replace the body sent upstream.
- :meth:`Gate.endpoints` is the fleet Envoy may connect to, by model.
- The :class:`Admitted` request then watches its response go by (headers, body chunks,
  which it may rewrite) and is :meth:`Admitted.finish`\\ ed exactly once, when the
  response ended or the stream was cut: that settles quota and frees the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.router.errors import RouterError


@dataclass(frozen=True)
class Reply:
    """A response Envoy sends to the client without going upstream."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def error(
        cls,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> Reply:
        """The router's OpenAI error body (:class:`RouterError`); ``Retry-After`` in whole seconds, at least 1."""
        return reply_for(RouterError(status, code, message, param=param, retry_after_s=retry_after_s))

    @classmethod
    def json(cls, status: int, doc: object) -> Reply:
        return cls(status, json.dumps(doc).encode(), {"content-type": "application/json"})


def reply_for(err: RouterError) -> Reply:
    """The reply Envoy sends for a refusal: the same body and ``Retry-After`` as the router's own."""
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in err.headers().items()}}
    return Reply(err.status, json.dumps(err.body()).encode(), headers)


@dataclass(frozen=True)
class Outcome:
    """How an admitted request's response ended."""

    status: int | None  # the upstream's status; None when no response headers arrived
    complete: bool  # the whole response reached the client


class Admitted(Protocol):
    """One admitted request, from the engine pick to its settlement."""

    @property
    def model(self) -> str:
        """The model served: Envoy sends the request to that model's cluster."""
        ...

    @property
    def engine(self) -> str:
        """``host:port`` of the engine reserved for this request."""
        ...

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """``host:port`` of the engines Envoy tries next, in order, if the engine cannot be connected."""
        ...

    @property
    def upstream_body(self) -> bytes | None:
        """The body to send upstream instead of the client's (None: the client's as it is)."""
        ...

    @property
    def upstream_headers(self) -> Mapping[str, str]:
        """Headers to add to the request sent upstream (the ``traceparent`` when the router traces)."""
        ...

    def response_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """Headers to add to the response, given its headers (``:status`` among them).

        Envoy's own replies (no engine answered) lack ``x-envoy-upstream-service-time``;
        an engine's carry ``x-kvfleet-upstream``: the ``host:port`` that answered.
        """
        ...

    def response_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """Observe one chunk of the response; return what to send instead (None: it as it is)."""
        ...

    async def finish(self, outcome: Outcome) -> None:
        """Settle the request (quota, engine, metrics); called exactly once."""
        ...


class Gate(Protocol):
    async def admit(self, headers: Mapping[str, str], body: bytes) -> Admitted | Reply:
        """Authenticate, validate, check quota, queue, pick: an engine or the reply to send."""
        ...

    def endpoints(self) -> Mapping[str, Sequence[str]]:
        """The engines (``host:port``, IP addresses) Envoy may send requests to, by model."""
        ...
