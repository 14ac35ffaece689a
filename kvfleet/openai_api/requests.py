"""The request bodies: ``/v1/completions``, ``/v1/chat/completions`` (messages, tool calls), ``/v1/embeddings``
and ``/tokenize``.

Where it sits: parsed by :func:`kvfleet.openai_api.parse_request` from a client's body, read by
the router (before spending quota) and the engine server (before building ``SamplingParams``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from kvfleet.openai_api.fields import (
    FORBID_EXTRA,
    MAX_LOGPROBS,
    MAX_N,
    MaxTokens,
    NamedToolChoice,
    ToolChoice,
    _Request,
    _SamplingFields,
)


def _check_prompt(v: Any) -> Any:
    # The union, checked by hand so that a wrong shape gets one clear message, not four.
    if isinstance(v, str):
        if not v:
            raise ValueError("the prompt is empty")
        return v
    if not isinstance(v, list) or not v:
        raise ValueError(
            "must be a string, a list of strings, a list of token ids, or a list of token-id lists (non-empty)"
        )
    if all(isinstance(x, str) for x in v):
        if not all(v):
            raise ValueError(f"prompt {v.index('')} is empty")
        return v
    if all(_is_token_id(x) for x in v):
        return v
    if all(isinstance(x, list) and x and all(_is_token_id(t) for t in x) for x in v):
        return v
    raise ValueError(
        "must be a string, a list of strings, a list of token ids (ints >= 0), or a list of non-empty token-id lists"
    )


def _as_list_of_inputs(v: Any) -> list[str | list[int]]:
    """A checked prompt (or embeddings input) as a list of inputs, each a string or a list of token ids."""
    if isinstance(v, str):
        return [v]
    if all(isinstance(x, int) for x in v):
        return [list(v)]
    return list(v)


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 31)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(
        default=None, ge=1, le=MAX_N, description="only equal to n (no extra samples)"
    )

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of: only best_of equal to n ({self.n}) is implemented (it ranks no extra samples), "
                f"got {self.best_of}"
            )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        return _check_prompt(v)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this engine")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by this engine")
        return v

    @model_validator(mode="after")
    def _tools_are_for_chat(self) -> CompletionRequest:
        if self.tools:
            raise ValueError("tools: only chat completions call tools (POST /v1/chat/completions)")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice: only chat completions call tools (POST /v1/chat/completions)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        return _as_list_of_inputs(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = FORBID_EXTRA

    type: Literal["text"]
    text: str


class MessageFunctionCall(BaseModel):
    model_config = FORBID_EXTRA

    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the history."""

    model_config = FORBID_EXTRA

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    model_config = FORBID_EXTRA

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers
    tool_calls: list[MessageToolCall] | None = None  # role "assistant": the calls it made
    reasoning: str | None = None  # role "assistant": its reasoning (vLLM's name) ...
    reasoning_content: str | None = None  # ... or its older one

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {self.role!r} ones")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only tool messages answer a call, not {self.role!r} ones")
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name}: only assistant messages carry reasoning, not {self.role!r} ones")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention): ``tool_calls`` with their
        arguments as objects (as vLLM hands them over), ``tool_call_id`` on tool results."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:  # Qwen3's templates read reasoning_content, gpt-oss's thinking
            out["reasoning_content"] = out["thinking"] = thought
        return out

    @property
    def text(self) -> str:
        """The content; text parts joined with a newline, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def check_template_kwargs(cls: type, v: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs``: no variable the request sets itself; Qwen3's ``enable_thinking`` a boolean."""
    if v is None:
        return v
    taken = sorted(set(v) & TEMPLATE_VARIABLES)
    if taken:
        raise ValueError(f"{taken[0]}: set by the request itself, not a chat template keyword")
    if "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
        raise ValueError(f"enable_thinking: must be a boolean, not {type(v['enable_thinking']).__name__}")
    return v


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None  # None: up to the context limit
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    include_reasoning: bool = True  # vLLM's: false drops the reasoning a reasoning parser splits off
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # gpt-oss's (its template reads it)

    _template_kwargs_fit = field_validator("chat_template_kwargs")(check_template_kwargs)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets beside the messages and tools (``reasoning_effort`` included)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must contain at least one message")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools (the functions the model may call)")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice: the function {choice.function.name!r} is not in tools {names}"
                )
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice``, defaulting as OpenAI's does: ``auto`` when tools are given, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


def _arguments(call: MessageToolCall) -> Any:
    """A call's arguments as an object when they are JSON (templates index into them), else the text."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's shape): a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a chat's default is False (its template writes them), as vLLM's
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as a chat request's (vLLM's tokenize takes it)

    _template_kwargs_fit = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _one_of_prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: exactly one of prompt or messages is required")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must contain at least one message")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings`` (OpenAI's shape): one input or many, each a string or token ids."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="matryoshka models only: truncate to this")
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        v = _check_prompt(v)
        if isinstance(v, list) and not all(_is_token_id(x) for x in v) and len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs in one request, got {len(v)}")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of inputs, each a string or a list of token ids."""
        return _as_list_of_inputs(self.input)

    # what the router reads of every body it admits: an embedding streams nothing and completes no token
    @property
    def stream(self) -> bool:
        return False

    @property
    def include_usage(self) -> bool:
        return False

    @property
    def cache_salt(self) -> str | None:
        return None

    @property
    def requested_max_tokens(self) -> int:
        return 0
