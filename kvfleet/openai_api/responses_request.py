"""The ``POST /v1/responses`` body (OpenAI's Responses API) and its translation to a chat request.

Where it sits: parsed here by the router (before spending quota) and by the engine server's
``routes/responses.py``; both then read it as the chat request it amounts to
(:meth:`ResponsesRequest.chat_request`): the input items become chat messages (a
``function_call`` an assistant turn's tool call, a ``function_call_output`` a ``tool``
message), ``instructions`` a first system message, ``text.format`` the ``response_format``,
``max_output_tokens`` the completion limit, the function tools chat tools. So prompts, tool
calling and structured outputs are the chat route's, token for token. A field path of the
chat request in an error is named as the Responses field (:func:`responses_param`).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvfleet.openai_api.fields import (
    FORBID_EXTRA,
    FunctionDef,
    MaxTokens,
    Temperature,
    TopP,
    _Request,
)
from kvfleet.openai_api.requests import ChatCompletionRequest

# Output items a client sends back carry their server-side ids and status; accepted, not used.
ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


class InputText(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text sent back
    logprobs: list[Any] | None = None


class SentBackItem(BaseModel):
    """An input item as the server gave it out and the client sends it back: with its ``id`` and ``status``."""

    model_config = FORBID_EXTRA

    id: str | None = None
    status: ITEM_STATUS | None = None


class MessageItem(SentBackItem):
    """A message of the conversation: ``{"role", "content"}`` (``type: "message"`` optional)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionCallItem(SentBackItem):
    """A call the model made earlier, sent back in the history."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(SentBackItem):
    """The result of a call, answering ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ReasoningText(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(SentBackItem):
    """A reasoning item sent back; a model without reasoning has none to continue, so it is dropped."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


class FunctionTool(BaseModel):
    """One of ``tools``: ``{"type": "function", "name", "description", "parameters", "strict"}``."""

    model_config = FORBID_EXTRA

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or a named ``json_schema``."""

    model_config = FORBID_EXTRA

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("name and schema are required when type is 'json_schema'")
        if self.type != "json_schema" and (self.name is not None or self.schema_ is not None):
            raise ValueError(f"name and schema are only for type 'json_schema' (type is {self.type!r})")
        return self


class TextConfig(BaseModel):
    model_config = FORBID_EXTRA

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(BaseModel):
    """``reasoning``: accepted; a model without a reasoning parser has no effort to set."""

    model_config = FORBID_EXTRA

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``."""

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1)
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    priority: int = Field(default=0, ge=-(1 << 31), lt=1 << 31, description="extension: lower runs first")
    cache_salt: str | None = Field(default=None, min_length=1, description="vLLM extension")

    @field_validator("input", mode="before")
    @classmethod
    def _input_not_empty(cls, v: Any) -> Any:
        if isinstance(v, (str, list)) and not v:
            raise ValueError("the input is empty")
        if isinstance(v, list):  # a message may leave out its type (EasyInputMessage)
            return [{"type": "message", **x} if isinstance(x, dict) and "type" not in x else x for x in v]
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools (the functions the model may call)")
        if isinstance(self.tool_choice, FunctionToolChoice):
            names = [t.name for t in self.tools or []]
            if self.tool_choice.name not in names:
                raise ValueError(
                    f"tool_choice: the function {self.tool_choice.name!r} is not in tools {names}"
                )
        if self.background and not self.store:
            raise ValueError("background: a background response must be stored (store: true)")
        if self.background and self.stream:
            raise ValueError("background: streaming a background response is not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (``ChatMessage`` fields), without the instructions."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                    last["tool_calls"] = [call]
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this amounts to, after ``history`` (a stored predecessor's messages)."""
        messages = [*history, *self.input_messages()]
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "priority": self.priority}
        for field in ("temperature", "top_p", "parallel_tool_calls", "cache_salt", "user"):
            if getattr(self, field) is not None:
                body[field] = getattr(self, field)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        effort = self.reasoning.effort if self.reasoning else None
        if effort in ("low", "medium", "high"):  # gpt-oss's efforts (its template reads reasoning_effort)
            body["reasoning_effort"] = effort
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": FunctionDef.model_validate(t.model_dump(exclude={"type"}))}
                for t in self.tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if isinstance(choice, FunctionToolChoice)
                else choice
            )
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return ChatCompletionRequest.model_validate(body, strict=False)


_PARAMS = (
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
    (re.compile(r"^messages.*"), "input"),
    (re.compile(r"^prompt$"), "input"),
    (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
)


def responses_param(param: str | None) -> str | None:
    """A chat request's field path as the Responses request names it."""
    if param is None:
        return None
    for pattern, replacement in _PARAMS:
        if pattern.search(param):
            return pattern.sub(replacement, param)
    return param


def responses_message(message: str) -> str:
    """An error message of the chat path, its leading field path named as the Responses field."""
    head, sep, rest = message.partition(": ")
    if not sep or " " in head:
        return message
    return f"{responses_param(head)}: {rest}"


def engine_tag(host: str) -> str:
    """The engine's tag in the ids of the responses it stores: a hash of the host the router reaches it at."""
    return hashlib.sha256(host.encode()).hexdigest()[:8]


def new_response_id(host: str | None) -> str:
    """``resp_<uuid>_<engine tag>``: a router finds the engine holding a stored response from its id alone
    (every router replica alike, with no shared state); ``resp_<uuid>`` when the host is unknown."""
    base = f"resp_{uuid.uuid4().hex}"
    return f"{base}_{engine_tag(host)}" if host else base


def engine_tag_of(response_id: str) -> str | None:
    """The engine tag of a response id this engine made (None: an id without one, such as vLLM's)."""
    head, sep, tag = response_id.rpartition("_")
    if not sep or not head.startswith("resp_") or len(tag) != 8:
        return None
    return tag if all(c in "0123456789abcdef" for c in tag) else None


class ResponseObject(BaseModel):
    """What ``POST /v1/responses`` and ``GET /v1/responses/{id}`` answer (documented loosely: the output
    items are OpenAI's; the engine builds them in ``engine/server/responses_shaping.py``)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
