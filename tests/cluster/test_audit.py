"""The audit log reader the e2e tests judge RBAC and GitOps writes by: events at ResponseComplete only,
subresources kept apart, a half-written last line left for the next read, windows by byte offset."""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.cluster.audit import AuditLog, forbidden, service_account, writes

OPERATOR = service_account("kvfleet", "kvfleet-operator")


def event(stage: str, verb: str, resource: str, code: int, user: str = OPERATOR, sub: str = "") -> str:
    ref = {"resource": resource, "namespace": "default", "name": "tiny"} | (
        {"subresource": sub} if sub else {}
    )
    return json.dumps({
        "stage": stage, "verb": verb, "user": {"username": user}, "objectRef": ref,
        "responseStatus": {"code": code}, "requestURI": f"/apis/x/{resource}",
    })  # fmt: skip


def test_only_completed_requests_count_and_subresources_are_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.write_text(
        "\n".join([
            event("ResponseStarted", "watch", "pods", 200),
            event("ResponseComplete", "patch", "inferenceservices", 200, sub="status"),
            event("ResponseComplete", "get", "secrets", 403),
        ]) + "\n"
    )  # fmt: skip
    events = list(AuditLog(log).events())
    assert [(e.verb, e.resource, e.code) for e in events] == [
        ("patch", "inferenceservices/status", 200),
        ("get", "secrets", 403),
    ]
    assert [e.resource for e in forbidden(events, [OPERATOR])] == ["secrets"]
    assert [e.resource for e in writes(events, [OPERATOR])] == ["inferenceservices/status"]
    assert forbidden(events, [service_account("kvfleet", "kvfleet-router")]) == []


def test_a_window_starts_at_an_offset_and_stops_before_a_half_written_line(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.write_text(event("ResponseComplete", "create", "deployments", 201) + "\n")
    audit = AuditLog(log)
    start = audit.offset()
    with log.open("a") as out:
        out.write(event("ResponseComplete", "delete", "services", 200) + "\n" + '{"stage": "Respon')
    assert [e.verb for e in audit.events(start)] == ["delete"]
    assert [e.verb for e in audit.events()] == ["create", "delete"]
    assert (
        list(AuditLog(tmp_path / "none.log").events()) == [] and AuditLog(tmp_path / "none.log").offset() == 0
    )
