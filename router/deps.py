"""FastAPI dependencies of the routes: the process's state and the authenticated tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from kvfleet.router import pipeline
from kvfleet.router.state import RouterState
from kvfleet.router.tenants import Tenant


# The dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a worker
# thread, a thread hop per request on the proxy's hot path.
async def get_state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


State = Annotated[RouterState, Depends(get_state)]


async def authenticated(
    state: State,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> Tenant:
    headers = {k: v for k, v in (("authorization", authorization), ("x-api-key", x_api_key)) if v is not None}
    return pipeline.authenticate(state, pipeline.credentials(headers))


AuthTenant = Annotated[Tenant, Depends(authenticated)]
