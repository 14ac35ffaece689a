"""The OpenAI-compatible wire format, shared by the engine server and the router (torch-free).

Where it sits: a client's JSON body is parsed here into a :class:`CompletionRequest` or a
:class:`ChatCompletionRequest` (the router does it before spending quota, the engine
server before building ``SamplingParams``); the responses and stream chunks the engine
sends back are in :mod:`kvfleet.openai_responses`; every error travels as :func:`error_body`,
OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

Bad input raises :class:`APIError` with the HTTP status, a message naming the field, the
value and the limit, and ``param`` set to the field's path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 128
MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20  # the engine's SamplingParams limit
MAX_TOKENS_LIMIT = 1 << 31  # beyond any context; the server then checks against its own max_model_len


class APIError(Exception):
    """An error the client caused (or a state it must wait out), carried as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'",
        param="model",
        code="model_not_found",
    )


def validation_error(exc: ValidationError) -> APIError:
    return errors_to_api_error(exc.errors(include_url=False))


def errors_to_api_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's (or FastAPI's) error list as one 400 naming the field's path, the problem and the value.

    The most specific error wins (the longest location: inside a union, the member that got furthest).
    """
    err = max(errors, key=lambda e: len(e["loc"]))  # max keeps the first of equals
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    if loc and loc[0] == "body":  # FastAPI's prefix for the request body
        loc = loc[1:]
    param = ".".join(loc) if loc else None
    message = str(err["msg"]).removeprefix("Value error, ")
    if param is None and (named := _FIELD_PREFIX.match(message)):
        param = named.group(1)  # a model-level check names its field first: "stream_options: ..."
        message = message[named.end() :]
    if err["type"] == "missing":
        message = "field required"
    elif err["type"] == "extra_forbidden":
        name = loc[-1] if loc else ""
        message = f"{UNSUPPORTED_FIELDS.get(name, 'not a field this server knows')}; remove it"
    elif err["type"] == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', message)}"
        )
    elif "input" in err and err["type"] != "value_error":
        message = f"{message} (got {_short(err['input'])})"
    return APIError(400, f"{param}: {message}" if param else message, param=param)


_FIELD_PREFIX = re.compile(r"^([a-z_][a-z0-9_.]*): ")


def _is_union_tag(part: int | str) -> bool:
    # pydantic names the member of a union it tried ("str", "list[str]") inside an error's location.
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], raw: bytes | str) -> M:
    """Parse a raw JSON body into ``model``; malformed JSON or a bad field raises :class:`APIError` (400)."""
    try:  # strictly: no invalid bytes, no overlong forms, no encoded surrogates
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    return validate_request(model, data)


def validate_request(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``, as OpenAI defines it: a named schema the output must match."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (one that matches it)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                f"json_schema is required when type is 'json_schema', and only then (type is {self.type!r})"
            )
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint on the output."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


STRUCTURED_BACKENDS = ("auto", "xgrammar")


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]


# Fields OpenAI or vLLM define that kvfleet does not implement: refused (400) naming the field, never ignored.
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "prompt_logprobs": "prompt logprobs are not implemented",
    "min_p": "min_p sampling is not implemented",
    "guided_whitespace_pattern": "a whitespace pattern for guided decoding is not implemented",
}
FORBID_EXTRA = ConfigDict(strict=True, extra="forbid")


def _first_lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or object, for a key) holding a lone UTF-16 surrogate (no encoder takes one)."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
        if any(isinstance(k, str) and _SURROGATE.search(k) for k in value):
            return path or "body"  # a key: name the object that holds it
    elif isinstance(value, list):
        items = enumerate(value)
    for key, item in items:
        found = _first_lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")

# A request body's top-level fields that no model here knows are refused (400 naming them, as
# OpenAI does: the router, which clients talk to) unless this holds a callback: then they are
# dropped and the callback gets their names (as vLLM does: the engine, which routers and
# gateways put their own fields in front of, sets it for its requests). UNSUPPORTED_FIELDS and
# fields inside nested objects (messages, stream_options) stay refused either way.
IGNORE_UNKNOWN_FIELDS: ContextVar[Callable[[list[str]], None] | None] = ContextVar(
    "kvfleet_ignore_unknown_fields", default=None
)


class _Request(BaseModel):
    """A request body: strict types, unknown fields refused (or ignored: IGNORE_UNKNOWN_FIELDS), no lone surrogates."""

    model_config = FORBID_EXTRA

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_fields(cls, data: Any) -> Any:
        report = IGNORE_UNKNOWN_FIELDS.get()
        if report is None or not isinstance(data, dict):
            return data
        unknown = [k for k in data if k not in cls.model_fields and k not in UNSUPPORTED_FIELDS]
        if not unknown:
            return data
        report(unknown)
        return {k: v for k, v in data.items() if k not in unknown}

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = _first_lone_surrogate(data, "")
        if bad is not None:
            raise ValueError(
                f"{bad}: invalid unicode: a lone UTF-16 surrogate (\\ud800-\\udfff) is not a character"
            )
        return data


class StreamOptions(BaseModel):
    model_config = FORBID_EXTRA

    include_usage: bool = False


class FunctionDef(BaseModel):
    model_config = FORBID_EXTRA

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    model_config = FORBID_EXTRA

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = FORBID_EXTRA

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    model_config = FORBID_EXTRA

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _SamplingFields(_Request):
    """The fields completions and chat share; ranges as OpenAI (and vLLM, for its extensions) document them."""

    model: str = Field(min_length=1)
    temperature: Temperature | None = None  # None: 1.0
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=-1, description="vLLM extension; -1 or null: no cut")
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, allow_inf_nan=False, description="vLLM extension; 1 or null: none"
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    include_stop_str_in_output: bool = Field(default=False, description="vLLM extension")
    response_format: ResponseFormat | None = None
    # Structured outputs beside response_format (vLLM's extensions; engine/server/structured_request.py).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(default=None, description="vLLM extension; only xgrammar")
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    priority: int = Field(default=0, ge=-(1 << 31), lt=1 << 31, description="extension: lower runs first")
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT, description="vLLM extension")
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        description="vLLM extension: prefix-cache blocks are shared only within a salt",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_is_positive_or_off(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1/null for no cut, got 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit() or int(key) >= 1 << 31:
                raise ValueError(f"keys must be token ids (integers >= 0 as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("guided_decoding_backend")
    @classmethod
    def _xgrammar_only(cls, v: str | None) -> str | None:
        if v is not None and v not in STRUCTURED_BACKENDS:
            raise ValueError(
                f"only {' or '.join(map(repr, STRUCTURED_BACKENDS))} is implemented, got {_short(v)}"
            )
        return v

    @model_validator(mode="after")
    def _fields_that_depend_on_others(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        limit = self.requested_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: must be at most max_tokens ({limit}), got {self.min_tokens}")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """The output-token limit the client asked for (None: none). Each request kind names its own
        field (``max_tokens``; chat also ``max_completion_tokens``), so each subclass answers; this
        private base is never instantiated."""
        raise NotImplementedError(f"{type(self).__name__} must say which field limits its output")

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


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
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

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

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {self.role!r} ones")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only tool messages answer a call, not {self.role!r} ones")
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
        return out

    @property
    def text(self) -> str:
        """The content; text parts joined with a newline, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None  # None: up to the context limit
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

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
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of_prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: exactly one of prompt or messages is required")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must contain at least one message")
        return self
