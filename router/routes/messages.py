"""``POST /v1/messages``, ``/v1/messages/count_tokens``, ``/tokenize``, ``/detokenize``: the other proxied routes.

Where it sits: beside :mod:`kvfleet.router.routes.completions` and as plain: the tenant's key
(``x-api-key``, as the ``anthropic`` SDK sends it, or ``Authorization: Bearer``), the admission
pipeline (:func:`kvfleet.router.pipeline.admit`, the body read by
:mod:`kvfleet.router.anthropic`), then the relay (:func:`kvfleet.router.proxy.serve`). Errors go
out in Anthropic's shape (:class:`kvfleet.anthropic_api.AnthropicErrors`, installed on the app).
``/tokenize`` and ``/detokenize`` (vLLM's) take the same way, their bodies read by
:mod:`kvfleet.router.tokenize`.
"""

from __future__ import annotations

from fastapi import APIRouter

from kvfleet.anthropic_api import COUNT_TOKENS, MESSAGES
from kvfleet.router.routes.completions import proxied
from kvfleet.router.tokenize import DETOKENIZE, TOKENIZE

router = APIRouter(tags=["anthropic"])

for _path in (MESSAGES, COUNT_TOKENS, TOKENIZE, DETOKENIZE):
    router.add_route(_path, proxied(_path), methods=["POST"], include_in_schema=False)
