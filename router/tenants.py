"""Authentication, the first step of the request path: ``Bearer <key>`` → tenant (docs/architecture.md §6).

The registry is filled from the tenants file at start, or replaced wholesale by the
Kubernetes watcher whenever a TenantQuota or its Secret changes. Keys are compared
in constant time and never logged or put in an error message.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.resources import TenantSpec


@dataclass(frozen=True)
class Tenant:
    """A tenant as the router enforces it: its spec, without the key."""

    spec: TenantSpec

    @property
    def name(self) -> str:
        return self.spec.tenant

    def may_use(self, model: str) -> bool:
        return not self.spec.models or model in self.spec.models


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantRegistry:
    """Maps API keys to tenants; ``replace`` swaps the whole table at once."""

    def __init__(self, entries: Iterable[tuple[str, TenantSpec]] = ()) -> None:
        self._table: list[tuple[bytes, Tenant]] = []
        self.replace(entries)

    def replace(self, entries: Iterable[tuple[str, TenantSpec]]) -> None:
        self._table = [(_digest(key), Tenant(spec)) for key, spec in entries]

    def authenticate(self, key: str) -> Tenant | None:
        # Invariant: the time taken depends only on the table's size, never on how much of
        # a key matches: every stored digest is compared, with compare_digest.
        probe = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._table:
            if hmac.compare_digest(digest, probe):
                found = tenant
        return found

    def claimed_by_another(self, tenant: Tenant, model: str) -> bool:
        """Another tenant lists ``model`` and this one does not: an adapter named in a TenantQuota
        is its tenants' own, even for a tenant allowed every model."""
        return model not in tenant.spec.models and any(
            model in other.spec.models for _, other in self._table if other.name != tenant.name
        )

    def names(self) -> list[str]:
        return sorted(t.name for _, t in self._table)

    def get(self, name: str) -> Tenant | None:
        for _, tenant in self._table:
            if tenant.name == name:
                return tenant
        return None
