"""The OpenAI-compatible wire format, shared by the engine server and the router (torch-free).

Where it sits: a client's JSON body is parsed here into a :class:`CompletionRequest` or a
:class:`ChatCompletionRequest` (the router does it before spending quota, the engine
server before building ``SamplingParams``); the responses and stream chunks the engine
sends back are in :mod:`kvfleet.openai_responses`; every error travels as :func:`error_body`,
OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

Bad input raises :class:`APIError` with the HTTP status, a message naming the field, the
value and the limit, and ``param`` set to the field's path. The parts: :mod:`.parsing` (errors,
parsing), :mod:`.fields` (what completions and chat share), :mod:`.requests` (the bodies).
"""

from kvfleet.openai_api.fields import (
    FORBID_EXTRA,
    IGNORE_UNKNOWN_FIELDS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_SEQUENCES,
    MAX_TOKENS_LIMIT,
    STRUCTURED_BACKENDS,
    ChatTool,
    FunctionDef,
    JsonSchemaFormat,
    MaxTokens,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsParams,
    Temperature,
    ToolChoice,
    TopP,
)
from kvfleet.openai_api.parsing import (
    UNSUPPORTED_FIELDS,
    APIError,
    error_body,
    errors_to_api_error,
    model_not_found,
    parse_request,
    validate_request,
    validation_error,
)
from kvfleet.openai_api.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    MessageFunctionCall,
    MessageToolCall,
    TextPart,
    TokenizeRequest,
)

__all__ = [
    "FORBID_EXTRA",
    "IGNORE_UNKNOWN_FIELDS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_SEQUENCES",
    "MAX_TOKENS_LIMIT",
    "STRUCTURED_BACKENDS",
    "UNSUPPORTED_FIELDS",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
    "CompletionRequest",
    "DetokenizeRequest",
    "FunctionDef",
    "JsonSchemaFormat",
    "MaxTokens",
    "MessageFunctionCall",
    "MessageToolCall",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputsParams",
    "Temperature",
    "TextPart",
    "EmbeddingRequest",
    "TokenizeRequest",
    "ToolChoice",
    "TopP",
    "error_body",
    "errors_to_api_error",
    "model_not_found",
    "parse_request",
    "validate_request",
    "validation_error",
]
