"""Errors the router answers with, in the OpenAI error body (docs/architecture.md §5, §6).

Every refusal is a :class:`RouterError`: its status, an OpenAI ``type``, a ``code``
(also the ``reason`` label of ``kvfleet_router_rejections_total``), the request field
it is about, and ``Retry-After`` where waiting helps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass
class RouterError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def sse(self) -> bytes:
        """The error as a stream event, for a failure after the stream began."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


async def router_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RouterError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
