"""``/v1/responses``: OpenAI's Responses API, whole, streamed, stored, in the background; get, cancel, delete.

Where it sits: a Responses request is read as the chat request it amounts to
(:meth:`~kvfleet.openai_api.responses_request.ResponsesRequest.chat_request`, after the stored
history of its ``previous_response_id``), then prompted, tool-planned, constrained and
submitted exactly as ``routes/chat.py`` does; :mod:`kvfleet.engine.server.responses_shaping`
shapes the answer. ``store`` (the default) keeps the response and its conversation in the
server's :class:`~kvfleet.engine.server.response_store.ResponseStore`; ``background`` answers
at once with an ``in_progress`` response that ``GET`` follows and ``cancel`` stops (its
sequence aborted). An error of the chat path names the Responses field
(:func:`~kvfleet.openai_api.responses_request.responses_param`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.chat_prompt import chat_prompt_ids
from kvfleet.engine.server.reasoning import keep_markers, request_reasoning
from kvfleet.engine.server.response_store import StoredResponse
from kvfleet.engine.server.responses_shaping import ResponseShaper, history_of
from kvfleet.engine.server.sse import GENERATION_RESPONSES, GenerationStream, generation_response
from kvfleet.engine.server.state import ServerState, State
from kvfleet.engine.server.tool_calling import constrain, plan_tools
from kvfleet.openai_api import APIError
from kvfleet.openai_api.responses_request import (
    ResponsesRequest,
    new_response_id,
    responses_message,
    responses_param,
)
from kvfleet.openai_responses import ErrorResponse

router = APIRouter(tags=["responses"])

_ERROR = {"model": ErrorResponse}
STORED_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the stored response"},
    400: {**_ERROR, "description": "not cancellable (not a running background response)"},
    404: {**_ERROR, "description": "no stored response with this id"},
}


@contextlib.contextmanager
def _named_as_responses() -> Iterator[None]:
    """An error of the chat path, its field named as the Responses request names it."""
    try:
        yield
    except APIError as exc:
        exc.param = responses_param(exc.param)
        exc.message = responses_message(exc.message)
        exc.args = (exc.message,)
        raise


def not_found(response_id: str, param: str | None = None) -> APIError:
    where = f"{param}: " if param else ""
    return APIError(
        404,
        f"{where}no stored response {response_id!r} on this engine (never stored with store: true, expired, "
        "or evicted)",
        param=param,
        code="response_not_found",
    )


def history(state: ServerState, previous_response_id: str | None, owner: str | None) -> list[dict[str, Any]]:
    """The stored conversation a follow-up continues; only a request of the same ``cache_salt`` (through
    the router: the same tenant) may continue it, to any other it does not exist."""
    if previous_response_id is None:
        return []
    stored = state.responses.get(previous_response_id)
    if stored is None or stored.owner != owner:
        raise not_found(previous_response_id, "previous_response_id")
    if stored.response["status"] in ("in_progress", "queued"):
        raise APIError(
            400,
            f"previous_response_id: the response {previous_response_id!r} is still in progress",
            param="previous_response_id",
        )
    return stored.history


@router.post("/v1/responses", responses=GENERATION_RESPONSES)
async def create_response(body: ResponsesRequest, state: State, request: Request) -> Any:
    lora = state.check_accepting(body.model)
    with _named_as_responses():
        past = history(state, body.previous_response_id, body.cache_salt)
        try:
            chat = body.chat_request(past)
        except ValueError as exc:  # a pydantic ValidationError of the translated chat request
            raise APIError(400, f"input: {exc}", param="input") from None
        plan = plan_tools(chat, state.tools)
        ids = chat_prompt_ids(state, chat.message_dicts(), plan.tools, chat.template_kwargs)
        gen.check_prompt_ids(ids, state.tokenizer.vocab_size, state.model.max_model_len, 0)
        max_tokens = gen.resolve_max_tokens(body.max_output_tokens, len(ids), state.model.max_model_len)
        params = constrain(plan, gen.sampling_params(chat, max_tokens, None, state.tokenizer.vocab_size))
        reasoning = request_reasoning(
            state.tools.reasoning_parser, chat.template_kwargs, plan.schema is not None
        )
        params = keep_markers(params, reasoning)
    shaper = ResponseShaper(body, plan, new_response_id(request.headers.get("host")), reasoning=reasoning)
    conversation = [*past, *body.input_messages()]
    submission = gen.Submission(shaper.id, [ids], [params], body.priority, lora)

    def keep(response: dict[str, Any]) -> StoredResponse | None:
        if not body.store:
            return None
        turn = history_of(response["output"])
        return state.responses.put(shaper.id, response, [*conversation, *turn], body.cache_salt)

    if body.background:
        with _named_as_responses():
            return await _background(state, shaper, submission, keep)

    async def collect(sub: gen.Submitted) -> JSONResponse:
        final = await gen.final_outputs(sub, 1)
        response = shaper.whole(final[0], sum(sub.prompt_lens))
        keep(response)
        return JSONResponse(response)

    with _named_as_responses():
        answer: JSONResponse | GenerationStream = await generation_response(
            state,
            request,
            submission,
            stream=body.stream,
            stream_body=lambda sub: shaper.events(sub, on_done=keep),
            collect=collect,
        )
    return answer


async def _background(
    state: ServerState, shaper: ResponseShaper, submission: gen.Submission, keep: Any
) -> Any:
    """Submit now (a refusal is still this request's 400), answer ``queued``; a task collects the output."""
    stored: StoredResponse = keep(shaper.response("queued", [], None))
    state.in_flight.enter()
    try:
        sub = await gen.submit(state, submission)
    except BaseException:
        state.in_flight.exit()
        state.responses.delete(shaper.id)
        raise

    async def run() -> None:
        try:
            stored.response = shaper.response("in_progress", [], None)
            final = await gen.final_outputs(sub, 1)
            done = shaper.whole(final[0], sum(sub.prompt_lens))
            stored.response, stored.history = done, [*stored.history, *history_of(done["output"])]
        except asyncio.CancelledError:
            gen.abort_unfinished(state, sub.streams)
            stored.response = shaper.response("cancelled", [], None)
        except Exception as exc:  # the engine failed it: the stored response says so
            error = {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}
            stored.response = {**shaper.response("failed", [], None), "error": error}
        finally:
            stored.task = None
            state.in_flight.exit()

    stored.task = asyncio.create_task(run())
    return JSONResponse(stored.response)


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored


@router.get("/v1/responses/{response_id}", responses=STORED_RESPONSES)
async def get_response(response_id: str, state: State) -> JSONResponse:
    return JSONResponse(_stored(state, response_id).response)


@router.post("/v1/responses/{response_id}/cancel", responses=STORED_RESPONSES)
async def cancel_response(response_id: str, state: State) -> JSONResponse:
    """Stop a background response that is still running; its stored state becomes ``cancelled``."""
    stored = _stored(state, response_id)
    task = stored.task
    if task is None:
        raise APIError(
            400,
            f"response {response_id!r} is {stored.response['status']}: only a running background response "
            "can be cancelled",
            param="response_id",
        )
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", responses=STORED_RESPONSES)
async def delete_response(response_id: str, state: State) -> JSONResponse:
    stored = _stored(state, response_id)
    if stored.task is not None:
        stored.task.cancel()
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
