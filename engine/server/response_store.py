"""The engine's stored responses (``store: true`` of ``POST /v1/responses``): bounded in number and age.

Where it sits: ``routes/responses.py`` puts each stored response here with the conversation it
ends (its chat messages, instructions left out, as OpenAI carries a conversation on); a
follow-up's ``previous_response_id`` reads that history back, ``GET /v1/responses/{id}``
reads the response, cancel stops a background one. A response that is gone (evicted, expired,
never stored, or stored on another engine) is a 404 naming ``previous_response_id``: a
follow-up never goes on without its history. Through the router, a follow-up is sent to the
engine that holds its predecessor (:mod:`kvfleet.router.responses`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_STORED = 4096
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as GET returns it (updated as a background one runs)
    history: list[dict[str, Any]]  # the chat messages up to and including its output
    expires_at: float
    task: asyncio.Task[None] | None = field(default=None, repr=False)  # a background response still running
    # The request's cache_salt (through the router: its tenant's); only a follow-up with the same continues it.
    owner: str | None = None


class ResponseStore:
    """At most ``max_entries`` responses, each for ``ttl_s`` after it was stored.

    Invariant: ``_entries`` is ordered by ``expires_at`` (insertion order with one TTL), so the
    expired ones and, past the bound, the oldest are always at its front.
    """

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_STORED,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError(
                f"a response store needs max_entries >= 1 and ttl_s > 0, got {max_entries}, {ttl_s}"
            )
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(
        self,
        response_id: str,
        response: dict[str, Any],
        history: list[dict[str, Any]],
        owner: str | None = None,
    ) -> StoredResponse:
        self._expire()
        self._entries.pop(response_id, None)
        stored = StoredResponse(response, history, self.clock() + self.ttl_s, owner=owner)
        self._entries[response_id] = stored
        while len(self._entries) > self.max_entries:
            _, evicted = self._entries.popitem(last=False)
            if evicted.task is not None:
                evicted.task.cancel()
        return stored

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires_at > now:
                return
            self._entries.popitem(last=False)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Responses API store (store: true, previous_response_id)")
    g.add_argument(
        "--responses-store-max",
        type=int,
        default=DEFAULT_MAX_STORED,
        help="at most this many stored responses; past it, the oldest is evicted (default %(default)s)",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help="seconds a stored response is kept (default %(default)s)",
    )


def store_from_args(args: argparse.Namespace) -> ResponseStore:
    """The store the flags ask for; a bound under 1 or a TTL of 0 is a ValueError naming both flags."""
    try:
        return ResponseStore(args.responses_store_max, args.responses_store_ttl)
    except ValueError:
        raise ValueError(
            "need --responses-store-max >= 1 and --responses-store-ttl > 0, got "
            f"{args.responses_store_max} and {args.responses_store_ttl}"
        ) from None
