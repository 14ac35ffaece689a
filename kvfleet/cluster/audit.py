"""Reading the local API server's audit log: who asked for what, and what the server answered.

Where it sits: :mod:`.controlplane` starts kube-apiserver with a Metadata-level audit policy
(``STATE/audit.log``, one JSON event per request); the e2e tests and the benchmark read it here
to prove what no client-side count can: that the chart's RBAC grants every verb kvfleet's service
accounts use (no 403 answered to them), and how many writes the operator made in a time window
(a GitOps re-apply of unchanged manifests must cause none).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@dataclass(frozen=True)
class Event:
    """One audited request, at its ResponseComplete stage."""

    user: str
    verb: str
    resource: str  # "inferenceservices", "deployments/scale", …: subresource after a slash
    namespace: str
    name: str
    code: int
    uri: str

    @property
    def is_write(self) -> bool:
        return self.verb in WRITE_VERBS


def _event(raw: dict[str, object]) -> Event | None:
    if raw.get("stage") != "ResponseComplete":
        return None
    ref = raw.get("objectRef") or {}
    assert isinstance(ref, dict)
    resource = str(ref.get("resource", ""))
    if ref.get("subresource"):
        resource += f"/{ref['subresource']}"
    user = raw.get("user") or {}
    status = raw.get("responseStatus") or {}
    assert isinstance(user, dict) and isinstance(status, dict)
    return Event(
        user=str(user.get("username", "")),
        verb=str(raw.get("verb", "")),
        resource=resource,
        namespace=str(ref.get("namespace", "")),
        name=str(ref.get("name", "")),
        code=int(status.get("code", 0)),
        uri=str(raw.get("requestURI", "")),
    )


class AuditLog:
    """The audit log file, read from a byte offset so a test can look at one window of requests."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def offset(self) -> int:
        """Where the log ends now: events after it are the ones a window sees."""
        return self.path.stat().st_size if self.path.exists() else 0

    def events(self, since: int = 0) -> Iterator[Event]:
        if not self.path.exists():
            return
        with self.path.open("rb") as log:
            log.seek(since)
            for line in log:
                if not line.endswith(b"\n"):
                    break  # a line still being written
                event = _event(json.loads(line))
                if event is not None:
                    yield event


def service_account(namespace: str, name: str) -> str:
    """The user name a service account's token authenticates as."""
    return f"system:serviceaccount:{namespace}:{name}"


def forbidden(events: Iterable[Event], users: Iterable[str]) -> list[Event]:
    """Requests of these users the server refused for lack of a grant (403)."""
    wanted = set(users)
    return [e for e in events if e.user in wanted and e.code == 403]


def writes(events: Iterable[Event], users: Iterable[str]) -> list[Event]:
    """Requests of these users that would change an object (whatever the server answered)."""
    wanted = set(users)
    return [e for e in events if e.user in wanted and e.is_write]
