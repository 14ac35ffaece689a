"""The engine serves a request whose body has top-level fields it does not know, as vLLM does.

Where it sits: a pure ASGI layer of the engine's app (``create_app``) sets
:data:`kvfleet.openai_api.IGNORE_UNKNOWN_FIELDS` for each request, so the shared request
models drop such fields instead of refusing them. The engine's clients are routers and
gateways, which add their own fields (vllm-router adds ``no_stop_trim`` to every body it
forwards); the router, whose clients are users, still answers a 400 naming the field, as
OpenAI does. Fields the engine knows and does not implement (``UNSUPPORTED_FIELDS``) and
unknown fields inside messages stay 400s. Each ignored name is logged once per process at
WARNING and counted in ``kvfleet_engine_ignored_request_fields_total{model_name, field}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvfleet.http_guard import ASGIApp, HttpMiddleware, Receive, Scope, Send
from kvfleet.openai_api import IGNORE_UNKNOWN_FIELDS

log = logging.getLogger(__name__)

# Field names are the client's choice: the first MAX_NAMED get a label (and a log line) of their
# own, the rest share one, so neither the metric's series nor this process's memory grow without bound.
MAX_NAMED = 64
MAX_NAME_LEN = 64
OTHER = "_other"
_seen: set[str] = set()  # per process: each name is logged once, whichever app or request met it


class IgnoredFields:
    """The callback the request models call with the names they dropped: log each once, count each."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self.count = count  # ServerMetrics.count_ignored_field: one more of that label

    def __call__(self, names: list[str]) -> None:
        for name in names:
            self.count(self._label(name))

    @staticmethod
    def _label(name: str) -> str:
        if name in _seen:
            return name
        if len(name) > MAX_NAME_LEN or len(_seen) >= MAX_NAMED:
            if OTHER not in _seen:
                _seen.add(OTHER)
                log.warning(
                    "ignoring request field %.80r and any later unknown field beyond the first %d names "
                    "(counted as field=%r, logged once)",
                    name,
                    MAX_NAMED,
                    OTHER,
                )
            return OTHER
        _seen.add(name)
        log.warning("ignoring request field %r: not a field this server knows (logged once)", name)
        return name


class IgnoreUnknownFields(HttpMiddleware):
    """Pure ASGI middleware: the request models ignore unknown top-level fields for the requests it serves."""

    def __init__(self, app: ASGIApp, report: IgnoredFields) -> None:
        super().__init__(app)
        self.report = report

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = IGNORE_UNKNOWN_FIELDS.set(self.report)
        try:
            await self.app(scope, receive, send)
        finally:
            IGNORE_UNKNOWN_FIELDS.reset(token)
