"""The API process reads a request's structured-output fields into one StructuredOutputSpec (torch-free)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.engine.sampling_params import StructuredOutputSpec
from kvfleet.engine.server.structured_request import structured_spec
from kvfleet.openai_api import APIError, ChatCompletionRequest, CompletionRequest, validate_request

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_TEXT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'


def _spec(extra: dict[str, Any]) -> StructuredOutputSpec | None:
    chat = validate_request(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]} | extra
    )
    completion = validate_request(CompletionRequest, {"model": "m", "prompt": "x"} | extra)
    spec = structured_spec(chat)
    assert structured_spec(completion) == spec and (
        spec is None or structured_spec(completion).source == spec.source
    )  # type: ignore[union-attr]
    return spec


@pytest.mark.parametrize(
    ("extra", "kind", "value", "source"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}}, "json", SCHEMA_TEXT, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "json_object", "", "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA_TEXT, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]', "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"', "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
        ({"guided_json": SCHEMA_TEXT}, "json", SCHEMA_TEXT, "guided_json"),
        ({"guided_regex": r"\d+", "guided_decoding_backend": "xgrammar"}, "regex", r"\d+", "guided_regex"),
        ({"guided_choice": ["yes"]}, "choice", '["yes"]', "guided_choice"),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"', "guided_grammar"),
    ],
)  # fmt: skip
def test_each_field_becomes_one_spec_that_names_it(
    extra: dict[str, Any], kind: str, value: str, source: str
) -> None:
    spec = _spec(extra)
    assert spec is not None
    assert (spec.kind, spec.value, spec.source, spec.param) == (kind, value, source, source)


def test_text_and_no_field_leave_the_output_free() -> None:
    assert _spec({}) is None
    assert _spec({"response_format": {"type": "text"}, "structured_outputs": {}}) is None


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json", "guided_json: not a valid JSON schema at properties/a/type: 'nope' is not valid under any of the given schemas"),
        ({"guided_json": "[1]"}, "guided_json", "guided_json: a JSON schema must be an object, got list"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "structured_outputs.regex: not a valid regular expression: missing ), unterminated subpattern at position 0"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "structured_outputs.choice: the choice list is empty"),
        ({"guided_grammar": "  "}, "guided_grammar", "guided_grammar: the grammar is empty"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "guided_regex: only one structured-output constraint per request, but response_format is set too"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "structured_outputs.choice: only one structured-output constraint per request, but structured_outputs.regex is set too"),
    ],
)  # fmt: skip
def test_a_bad_or_doubled_constraint_is_a_400_naming_the_field(
    extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(APIError) as refused:
        _spec(extra)
    assert (refused.value.status_code, refused.value.param, refused.value.message) == (400, param, message)
