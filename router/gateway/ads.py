"""The router's Aggregated Discovery Service: Envoy's listeners and clusters over one gRPC stream.

State-of-the-world ADS (the xDS protocol's ``StreamAggregatedResources``): Envoy asks
for a type URL; the router answers with every resource of that type, a version and a
nonce. Envoy then ACKs (same version and nonce back) or NACKs (``error_detail`` set,
the previous version). The resources come from the gateway's config and the router's
fleet (:mod:`kvfleet.router.gateway.xds`); when the fleet changes, :meth:`AdsServer.update`
takes the new snapshot and every open stream pushes it to its Envoy unasked; and
:meth:`AdsServer.until_acked` waits until an Envoy has taken a resource.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

import betterproto2
from envoy_data_plane.envoy.service.discovery.v3 import (
    AggregatedDiscoveryServiceBase,
    DiscoveryRequest,
    DiscoveryResponse,
)
from envoy_data_plane.google.protobuf import Any as AnyProto

log = logging.getLogger(__name__)

Snapshot = Mapping[str, Sequence[betterproto2.Message]]


def _version(packed: Mapping[str, Sequence[AnyProto]]) -> str:
    digest = hashlib.sha256()
    for type_url in sorted(packed):
        digest.update(type_url.encode())
        for item in packed[type_url]:
            digest.update(bytes(item))
    return digest.hexdigest()[:16]


class AdsServer(AggregatedDiscoveryServiceBase):
    """Serves the latest snapshot of resources, by type URL, to every Envoy that connects."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.acked: dict[str, str] = {}
        self.acked_names: dict[str, frozenset[str]] = {}  # of the resources of each type acked last
        self.rejected: dict[str, str] = {}
        self.streams = 0  # opened so far, and requests received on them: what a stuck start shows
        self.requests = 0
        self._changed = asyncio.Event()
        self._acked = asyncio.Event()
        self._take(snapshot)

    def _take(self, snapshot: Snapshot) -> None:
        self.packed = {url: [AnyProto.pack(r) for r in items] for url, items in snapshot.items()}
        self.names = {
            url: frozenset(str(getattr(r, "name", "")) for r in items) for url, items in snapshot.items()
        }
        self.version = _version(self.packed)

    def _ack(self, type_url: str) -> None:
        self.acked[type_url] = self.version
        self.acked_names[type_url] = self.names.get(type_url, frozenset())
        acked, self._acked = self._acked, asyncio.Event()
        acked.set()

    async def until_acked(self, type_url: str, name: str, timeout_s: float) -> bool:
        """Wait until an Envoy has acknowledged a version holding resource ``name`` (False: timed out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while name not in self.acked_names.get(type_url, frozenset()):
            waiter = self._acked
            try:
                await asyncio.wait_for(waiter.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
        return True

    def update(self, snapshot: Snapshot) -> bool:
        """Serve ``snapshot`` from now on; True (and every stream pushes it) when it differs."""
        before = self.version
        self._take(snapshot)
        if self.version == before:
            return False
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    def response(self, type_url: str) -> DiscoveryResponse:
        return DiscoveryResponse(
            version_info=self.version,
            resources=list(self.packed.get(type_url, [])),
            type_url=type_url,
            nonce=uuid.uuid4().hex,
        )

    def answer(self, request: DiscoveryRequest, sent: dict[str, str]) -> DiscoveryResponse | None:
        """What to send for one request (None: it acknowledges what was sent).

        Invariant: each type URL gets a response on its first request and whenever Envoy
        reports a version other than ours; an ACK or NACK of the latest nonce gets none,
        and neither does a request answering an older nonce (a newer response is on its way).
        """
        type_url = request.type_url
        if request.response_nonce and type_url in sent and request.response_nonce != sent[type_url]:
            return None
        if request.error_detail is not None and request.error_detail.message:
            self.rejected[type_url] = request.error_detail.message
            log.error(
                "Envoy rejected %s version %s: %s", type_url, self.version, request.error_detail.message
            )
        if request.response_nonce and request.response_nonce == sent.get(type_url):
            if request.version_info == self.version:
                self._ack(type_url)
            return None
        if type_url in sent and request.version_info == self.version:
            return None
        return self._send(type_url, sent)

    def _send(self, type_url: str, sent: dict[str, str]) -> DiscoveryResponse:
        reply = self.response(type_url)
        sent[type_url] = reply.nonce
        return reply

    def pushes(self, sent: dict[str, str], versions: dict[str, str]) -> list[DiscoveryResponse]:
        """The responses a stream owes its Envoy: the latest version of each type it asked for."""
        owed = [url for url in sent if versions.get(url) != self.version]
        for url in owed:
            versions[url] = self.version
        return [self._send(url, sent) for url in owed]

    async def stream_aggregated_resources(
        self, messages: AsyncIterator[DiscoveryRequest]
    ) -> AsyncIterator[DiscoveryResponse]:
        # Invariant: after every wake-up (a request, or a new snapshot) the stream has sent
        # each type URL Envoy asked for at the latest version.
        sent: dict[str, str] = {}
        versions: dict[str, str] = {}
        self.streams += 1
        inbox: asyncio.Queue[DiscoveryRequest | None] = asyncio.Queue()
        reader = asyncio.create_task(_pump(messages, inbox))
        try:
            while True:
                got = asyncio.ensure_future(inbox.get())
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({got, changed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if got.done():
                    request = got.result()
                    if request is None:
                        return
                    self.requests += 1
                    reply = self.answer(request, sent)
                    if reply is not None:
                        versions[request.type_url] = reply.version_info
                        yield reply
                else:
                    got.cancel()
                for reply in self.pushes(sent, versions):
                    yield reply
        finally:
            reader.cancel()


async def _pump(
    messages: AsyncIterator[DiscoveryRequest], inbox: asyncio.Queue[DiscoveryRequest | None]
) -> None:
    try:
        async for request in messages:
            await inbox.put(request)
    finally:
        await inbox.put(None)
