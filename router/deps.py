"""FastAPI dependencies of the routes: the process's state and the authenticated tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from kvfleet.router.errors import RouterError
from kvfleet.router.state import RouterState
from kvfleet.router.tenants import Tenant


# The dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a worker
# thread, a thread hop per request on the proxy's hot path.
async def get_state(request: Request) -> RouterState:
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


async def authenticated(state: State, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    return authenticate(state, authorization)


AuthTenant = Annotated[Tenant, Depends(authenticated)]
