"""The Responses API through the router: which engine holds a stored response, and what its answers report.

Where it sits: the pipeline's placement (:func:`kvfleet.router.pipeline.place`) asks
:func:`pinned_exclusions` where a follow-up (``previous_response_id``) may go;
``routes/responses.py`` asks :func:`engine_for` where ``GET``/cancel/``DELETE`` of a stored
response go; the accounting (:class:`kvfleet.router.accounting.Exchange`) reads a Responses
answer's usage and progress with :func:`read_event` / :func:`chat_usage`.

Affinity without shared state: an engine's response ids end in a tag of the host the router
reaches it at (:func:`~kvfleet.openai_api.responses_request.new_response_id`), so every router
replica finds the engine from the id alone, whichever replica relayed the first response. A
follow-up whose engine has left the fleet is a 404 naming ``previous_response_id``, never a
silent new conversation; an id without a tag (a vLLM engine's) is placed as any request, and
an engine that lacks it answers the 404 itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvfleet.openai_api.responses_request import engine_tag, engine_tag_of
from kvfleet.router.errors import RouterError
from kvfleet.router.requests import ParsedRequest

if TYPE_CHECKING:
    from kvfleet.router.state import RouterState

_DONE = {"response.completed", "response.incomplete", "response.failed"}
_CONTENT = {"response.output_text.delta", "response.function_call_arguments.delta"}


def _gone(response_id: str, param: str | None) -> RouterError:
    where = f"{param}: " if param else ""
    return RouterError(
        404,
        "response_not_found",
        f"{where}the engine that stored response {response_id!r} is not in the fleet (it left or restarted)",
        param=param,
    )


def engine_for(state: RouterState, response_id: str, param: str | None = None) -> str | None:
    """The URL of the engine that stored ``response_id``; None when the id names no engine."""
    tag = engine_tag_of(response_id)
    if tag is None:
        return None
    for url in state.fleet.engines:
        if engine_tag(urlsplit(url).netloc) == tag:
            return url
    raise _gone(response_id, param)


def pinned_exclusions(state: RouterState, req: ParsedRequest) -> list[str]:
    """The engines a follow-up must not go to: all but its predecessor's (none for other requests)."""
    if req.previous_response_id is None:
        return []
    target = engine_for(state, req.previous_response_id, "previous_response_id")
    if target is None:
        return []
    return [url for url in state.fleet.engines if url != target]


@dataclass(frozen=True)
class ResponsesEvent:
    usage: dict[str, Any] | None  # the chat-shaped usage of the final response
    done: bool  # the stream's last event
    content: bool  # a text or arguments delta (for TTFT and ITL)
    status: str | None  # the final response's status


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses usage (``input_tokens``, ``output_tokens``) as the accounting reads chat's."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt, output = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def read_event(obj: dict[str, Any]) -> ResponsesEvent:
    kind = obj.get("type")
    if kind in _DONE:
        response = obj.get("response")
        response = response if isinstance(response, dict) else {}
        return ResponsesEvent(chat_usage(response.get("usage")), True, False, response.get("status"))
    return ResponsesEvent(None, False, kind in _CONTENT, None)
