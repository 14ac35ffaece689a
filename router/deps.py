"""FastAPI dependencies of the routes: the process's state and the authenticated tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from kvfleet.router.errors import RouterError
from kvfleet.router.state import RouterState
from kvfleet.router.tenants import Tenant


def get_state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


State = Annotated[RouterState, Depends(get_state)]


def authenticate(state: State, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    """``Authorization: Bearer <key>`` → tenant, or 401 (the key is never echoed or logged)."""
    scheme, _, key = (authorization or "").partition(" ")
    tenant = state.tenants.authenticate(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
    if tenant is None:
        reason = "missing_api_key" if not authorization else "invalid_api_key"
        state.metrics.reject("unknown", "unknown", reason, 401)
        message = (
            "missing API key: send 'Authorization: Bearer <key>'" if not authorization else "invalid API key"
        )
        raise RouterError(401, reason, message)
    return tenant


AuthTenant = Annotated[Tenant, Depends(authenticate)]
