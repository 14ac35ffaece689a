"""An in-memory stand-in for the process node's API client (kvfleet/cluster/apiclient.Api), for unit tests.

It holds objects by path, answers TokenRequests with numbered tokens and records every write, so a
test can drive a pod worker without a cluster and read what it would have sent.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

Obj = dict[str, Any]


class FakeApi:
    server = "https://127.0.0.1:6443"
    ca_pem = b"-----BEGIN CERTIFICATE-----\nfake\n-----END CERTIFICATE-----\n"
    insecure = False

    def __init__(self, objects: dict[str, Obj] | None = None) -> None:
        self.objects = dict(objects or {})
        self.writes: list[tuple[str, str, Obj | None]] = []
        self.tokens = 0
        self.lock = threading.Lock()

    def get(self, path: str, **params: Any) -> Obj | None:
        return self.objects.get(path)

    def create(self, path: str, body: Obj) -> Obj:
        with self.lock:
            self.writes.append(("POST", path, body))
            if path.endswith("/token"):
                self.tokens += 1
                return {**body, "status": {"token": f"token-{self.tokens}"}}
            return body

    def patch(self, path: str, body: Obj, content_type: str = "") -> Obj:
        with self.lock:
            self.writes.append(("PATCH", path, body))
        return body

    def delete(self, path: str, body: Obj | None = None) -> Obj:
        with self.lock:
            self.writes.append(("DELETE", path, body))
        return {}

    def statuses(self) -> list[Obj]:
        with self.lock:
            return [
                body["status"]
                for verb, path, body in self.writes
                if verb == "PATCH" and path.endswith("/status") and body
            ]


def secret(data: dict[str, str]) -> Obj:
    return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


class FakeWatchApi(FakeApi):
    """A FakeApi whose list and watch answer from scripted pod listings and watch events."""

    def __init__(self, objects: dict[str, Obj] | None = None) -> None:
        super().__init__(objects)
        self.listing: list[Obj] = []
        self.events: list[Obj] = []

    def request(
        self, method: str, path: str, body: Obj | None = None, content_type: str | None = None, **params: Any
    ) -> Obj:
        return {"metadata": {"resourceVersion": "10"}, "items": self.listing}

    def watch(self, path: str, timeout_s: int = 240, **params: Any) -> Any:
        yield from self.events

    def close(self) -> None:
        pass
