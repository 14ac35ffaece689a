"""The fields that completions and chat share: sampling, structured outputs, tools, unknown-field policy.

Where it sits: the base models of :mod:`kvfleet.openai_api.requests` (``CompletionRequest``,
``ChatCompletionRequest``); strict pydantic, a field kvfleet knows and does not implement is a
400 naming it (:data:`UNSUPPORTED_FIELDS`), an unknown one too unless the engine's
:data:`IGNORE_UNKNOWN_FIELDS` switch is set for the request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvfleet.openai_api.parsing import UNSUPPORTED_FIELDS, _short

MAX_N = 128
MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20  # the engine's SamplingParams limit
MAX_TOKENS_LIMIT = 1 << 31  # beyond any context; the server then checks against its own max_model_len


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


class StructuredOutputsParams(BaseModel):
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
    structured_outputs: StructuredOutputsParams | None = None
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
