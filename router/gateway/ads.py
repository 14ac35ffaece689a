"""The router's Aggregated Discovery Service: Envoy's listeners and clusters over one gRPC stream.

State-of-the-world ADS (the xDS protocol's ``StreamAggregatedResources``): Envoy asks
for a type URL; the router answers with every resource of that type, a version and a
nonce. Envoy then ACKs (same version and nonce back) or NACKs (``error_detail`` set,
the previous version). The resources depend only on the gateway's config
(:mod:`kvfleet.router.gateway.xds`), so one version serves the whole process.
"""

from __future__ import annotations

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


def _version(packed: Mapping[str, Sequence[AnyProto]]) -> str:
    digest = hashlib.sha256()
    for type_url in sorted(packed):
        for item in packed[type_url]:
            digest.update(bytes(item))
    return digest.hexdigest()[:16]


class AdsServer(AggregatedDiscoveryServiceBase):
    """Serves a fixed snapshot of resources, by type URL, to every Envoy that connects."""

    def __init__(self, snapshot: Mapping[str, Sequence[betterproto2.Message]]) -> None:
        self.packed = {url: [AnyProto.pack(r) for r in items] for url, items in snapshot.items()}
        self.version = _version(self.packed)
        self.acked: dict[str, str] = {}
        self.rejected: dict[str, str] = {}

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
        reports a version other than ours; an ACK or NACK of the latest nonce gets none.
        """
        type_url = request.type_url
        if request.error_detail is not None and request.error_detail.message:
            self.rejected[type_url] = request.error_detail.message
            log.error(
                "Envoy rejected %s version %s: %s", type_url, self.version, request.error_detail.message
            )
        if request.response_nonce and request.response_nonce == sent.get(type_url):
            if request.version_info == self.version:
                self.acked[type_url] = self.version
            return None
        if type_url in sent and request.version_info == self.version:
            return None
        reply = self.response(type_url)
        sent[type_url] = reply.nonce
        return reply

    async def stream_aggregated_resources(
        self, messages: AsyncIterator[DiscoveryRequest]
    ) -> AsyncIterator[DiscoveryResponse]:
        sent: dict[str, str] = {}
        async for request in messages:
            reply = self.answer(request, sent)
            if reply is not None:
                yield reply
