"""A real OTLP/HTTP trace receiver for tests: what the router and the engines export, decoded.

Where it sits: the tracing tests (``e2e/test_tracing.py``) point ``OTEL_EXPORTER_OTLP_ENDPOINT``
at :class:`OtlpReceiver` and read back :class:`ReceivedSpan` s. It answers ``POST /v1/traces``
(``application/x-protobuf``) as a collector does, decoding each ``ExportTraceServiceRequest``
with ``opentelemetry-proto``, the same message definitions the SDK's exporter encodes with.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)  # name -> time (ns)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        str(resource.get("service.name", "")),
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        {e.name: e.time_unix_nano for e in s.events},
                    )
                )
    return out


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` an OTLP/HTTP endpoint at ``r.endpoint``; ``r.spans`` so far."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.spans.extend(decode(body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30.0) -> dict[str, ReceivedSpan]:
        """The spans of ``trace_id`` by name, once every one of ``names`` has arrived (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = {s.name: s for s in list(self.spans) if s.trace_id == trace_id}
            if names <= found.keys() or time.monotonic() > deadline:
                return found
            time.sleep(0.05)
