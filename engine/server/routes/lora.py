"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: adapters at run time, vLLM's bodies.

Where it sits: the API process forwards each to the engine core as a ``LoraCmd``
(``engine/core/loop.py``), where ``Engine.load_lora`` checks the adapter's config and weights
before registering it (nothing resident changes until a request asks for it) and
``Engine.unload_lora`` refuses an adapter a request still runs or waits under. A refusal is
the OpenAI error body naming the field: 400 bad adapter or name taken, 404 unknown adapter,
409 in use. Success answers with vLLM's plain-text line.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvfleet.engine.lora.config import LoraError
from kvfleet.engine.server.sse import GENERATION_RESPONSES
from kvfleet.engine.server.state import State
from kvfleet.openai_api import APIError

router = APIRouter(tags=["lora"])
# The errors are JSON although the success is plain text: say so, else FastAPI documents them as text/plain.
_JSON_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
RESPONSES: dict[int | str, dict[str, Any]] = {
    k: {"description": v["description"], "content": _JSON_ERROR}
    for k, v in GENERATION_RESPONSES.items()
    if k in (400, 404, 503)
}
RESPONSES[404] = {**RESPONSES[404], "description": "unknown adapter"}
RESPONSES[409] = {**RESPONSES[400], "description": "the adapter is in use by a request"}
# Success is vLLM's plain-text line; errors stay JSON (a route-wide PlainTextResponse class would
# document the error bodies as text/plain too).
RESPONSES[200] = {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "vLLM's line"}


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="the name requests use as their model")
    lora_path: str = Field(min_length=1, description="a PEFT adapter folder on the engine's file system")


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's, accepted and unused: adapters are known by name


@router.post("/v1/load_lora_adapter", responses=RESPONSES)
async def load_lora_adapter(body: LoadLoraAdapterRequest, state: State) -> PlainTextResponse:
    await _run(state, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=RESPONSES)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, state: State) -> PlainTextResponse:
    await _run(state, body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _run(state: State, name: str, path: str | None) -> None:
    if path is not None and name == state.model.name:
        raise APIError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
    try:
        await state.engine.lora_op(name, path)
    except LoraError as exc:
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        raise APIError(exc.status, str(exc), type=kind, param=exc.field, code=exc.code) from None
