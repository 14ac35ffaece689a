"""A request's prompt token ids as the engine will see them, for the precise-prefix policy.

Where it sits: :func:`kvfleet.router.pipeline.place` asks for them before placing a request of a
model routed ``precise-prefix`` (:meth:`kvfleet.router.fleet.Fleet.wants_precise`). The router
holds no tokenizer (the kvfleet image has no ``tokenizers``, and a chat template is the model's
own), so it asks one ready engine of the model: ``POST /tokenize``, which kvfleet and vLLM both
serve, with the request's ``prompt`` or its ``messages`` (the chat template applied as for the
chat completion: the same ``add_generation_prompt``, ``tools`` and template kwargs). A prompt
already given as token ids needs no call. Any failure gives None: the request is placed by
today's estimate, never refused for it.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from kvfleet.router.requests import CHAT, COMPLETIONS, ParsedRequest

log = logging.getLogger(__name__)

_CHAT_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)


def tokenize_body(req: ParsedRequest) -> dict[str, Any] | list[int] | None:
    """The ``/tokenize`` body for the request, its token ids if it already is some, or None (not a
    completion or a chat: a Responses or Messages request is placed by the estimate)."""
    body = req.body
    if req.path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return {"model": req.model, "prompt": prompt} if isinstance(prompt, str) else None
    if req.path == CHAT:
        return {"model": req.model, **{k: body[k] for k in _CHAT_FIELDS if k in body}}
    return None


async def prompt_token_ids(
    client: httpx.AsyncClient, engine_url: str, req: ParsedRequest
) -> list[int] | None:
    wanted = tokenize_body(req)
    if wanted is None or isinstance(wanted, list):
        return wanted
    try:
        answer = await client.post(f"{engine_url}/tokenize", json=wanted, timeout=2.0)
        answer.raise_for_status()
        tokens = answer.json().get("tokens")
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("precise-prefix: %s could not tokenize (%s); placed by the estimate", engine_url, exc)
        return None
    return tokens if isinstance(tokens, list) else None
