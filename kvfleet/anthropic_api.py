"""The Anthropic Messages wire format (``/v1/messages``), shared by the engine server and the router (torch-free).

Where it sits: beside :mod:`kvfleet.openai_api`. A client's body is validated here into a
:class:`MessagesRequest` (or :class:`CountTokensRequest`) by the router before it spends quota
and by the engine before it renders the prompt; :meth:`MessagesRequest.chat_request` turns it
into the :class:`~kvfleet.openai_api.ChatCompletionRequest` the engine's chat path already
serves (system and content blocks become chat messages, ``tool_use`` blocks assistant tool
calls, ``tool_result`` blocks tool messages, ``tool_choice`` ``any``/``tool`` become
``required``/a named function). Every error on these routes goes out in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}`` (:class:`AnthropicErrors`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from kvfleet.http_guard import ASGIApp, HttpMiddleware, Message, Receive, Scope, Send
from kvfleet.openai_api import FORBID_EXTRA, ChatCompletionRequest, validate_request
from kvfleet.openai_api.fields import _Request

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"


class TextBlock(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(BaseModel):
    """A call the assistant made earlier, sent back in the history."""

    model_config = FORBID_EXTRA

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    """What a tool returned for the call ``tool_use_id`` (a user turn)."""

    model_config = FORBID_EXTRA

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(BaseModel):
    """The assistant's reasoning of an earlier turn, sent back (with its tool_use) in the history."""

    model_config = FORBID_EXTRA

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # kvfleet signs nothing: any signature is accepted


class ThinkingConfig(BaseModel):
    """``thinking``: ``enabled`` or ``disabled`` become the chat template's ``enable_thinking`` (Qwen3's
    switch); ``budget_tokens`` is taken but not enforced (``max_tokens`` bounds reasoning and text)."""

    model_config = FORBID_EXTRA

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class InputMessage(BaseModel):
    model_config = FORBID_EXTRA

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> InputMessage:
        for block in self.content if isinstance(self.content, list) else []:
            if isinstance(block, ToolUseBlock) and self.role != "assistant":
                raise ValueError("a tool_use block belongs to an assistant message, not a user one")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ValueError("a tool_result block belongs to a user message, not an assistant one")
            if isinstance(block, ThinkingBlock) and self.role != "assistant":
                raise ValueError("a thinking block belongs to an assistant message, not a user one")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """This turn as OpenAI chat messages: tool results first (as ``tool`` messages), then the text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        text = "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in self.content
            if isinstance(b, ToolUseBlock)
        ]
        thinking = "\n".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or thinking or not out:
            out.append({"role": self.role, "content": text})
        if thinking:
            out[-1]["reasoning"] = thinking
        return out


class Tool(BaseModel):
    model_config = FORBID_EXTRA

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AutoChoice(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyChoice(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class NamedChoice(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class NoneChoice(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["none"]


ToolChoice = Annotated[AutoChoice | AnyChoice | NamedChoice | NoneChoice, Field(discriminator="type")]


class _Prompted(_Request):
    """What a message and a token count share: the prompt (model, system, messages, tools)."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> _Prompted:
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools (the tools the model may call)")
        if isinstance(choice, NamedChoice) and choice.name not in [t.name for t in self.tools or []]:
            raise ValueError(f"tool_choice: the tool {choice.name!r} is not in tools")
        return self

    def chat_body(self) -> dict[str, Any]:
        """The prompt's part of the equivalent chat completion request."""
        messages: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        if system:
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            messages.extend(m.chat_messages())
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function",
                "function": {"name": getattr(choice, "name", "")},
            }
            if getattr(choice, "disable_parallel_tool_use", None):
                body["parallel_tool_calls"] = False
        return body


class CountTokensRequest(_Prompted):
    """``POST /v1/messages/count_tokens``: how many prompt tokens the message would have."""

    def chat_request(self) -> ChatCompletionRequest:
        return validate_request(ChatCompletionRequest, self.chat_body())


class MessagesRequest(_Prompted):
    """``POST /v1/messages`` (``temperature``, ``top_p``, ``top_k`` as vLLM's Messages endpoint takes them)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's extension, set by the router
    thinking: ThinkingConfig | None = None

    def chat_request(self) -> ChatCompletionRequest:
        body = self.chat_body()
        body["max_tokens"] = self.max_tokens
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        for name in ("temperature", "top_p", "top_k", "cache_salt"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        return validate_request(ChatCompletionRequest, body)


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrors(HttpMiddleware):
    """Pure ASGI middleware: a JSON error answer to a ``/v1/messages`` request is rewritten in
    Anthropic's shape, its message kept (an OpenAI body's ``error.message``); other paths pass."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not str(scope.get("path", "")).startswith(MESSAGES):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def rewrite(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                held.append(message)
                if message.get("more_body"):
                    return
                await _send_rewritten(send, held)
                held.clear()
                return
            await send(message)

        await self.app(scope, receive, rewrite)


async def _send_rewritten(send: Send, held: list[Message]) -> None:
    start, content = held[0], b"".join(m.get("body", b"") for m in held[1:])
    try:
        body = json.loads(content)
        message = str(body["error"]["message"]) if body.get("type") != "error" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        message = content.decode("utf-8", errors="replace") or "error"
    if message is not None:
        content = json.dumps(anthropic_error_body(start["status"], message)).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(content)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": content})
