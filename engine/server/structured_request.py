"""A request's structured-output constraint: read from its fields, checked, as one StructuredOutputSpec.

Where it sits: in the API process (torch-free), called by ``generation.sampling_params`` for
completions and chat alike. It reads OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object and its older ``guided_*`` fields; at most
one of them may constrain a request. What this process can check it checks here, so that the
400 names the field: a JSON schema against its meta-schema (``jsonschema``), a regex with
Python's ``re`` (close to xgrammar's dialect), an empty choice list, an empty grammar. What only
the grammar engine can tell (an EBNF syntax error, a schema it cannot compile in time) comes
back from the core as the same kind of 400 (engine/structured).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from kvfleet.engine.sampling_params import StructuredOutputSpec
from kvfleet.openai_api import APIError, ChatCompletionRequest, CompletionRequest

Request = CompletionRequest | ChatCompletionRequest


def structured_spec(req: Request) -> StructuredOutputSpec | None:
    """The request's constraint (None: a free output); a bad or doubled constraint is a 400 naming the field."""
    found = _candidates(req)
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise APIError(
            400,
            f"{second}: only one structured-output constraint per request, but {first} is set too",
            param=second,
        )
    if not found:
        return None
    param, kind, value = found[0]
    return StructuredOutputSpec(kind, _checked(param, kind, value), source=param)


def _candidates(req: Request) -> list[tuple[str, Any, Any]]:
    """(field path, kind, raw value) of every constraint the request sets, in field order."""
    found: list[tuple[str, Any, Any]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", ""))
    elif rf is not None and rf.json_schema is not None:
        schema = rf.json_schema.schema_
        path = "response_format.json_schema.schema"
        found.append((path, "json", schema) if schema is not None else (path, "json_object", ""))
    so = req.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        found.extend((f"structured_outputs.{k}", k, v) for k, v in fields.items() if v is not None)
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", ""))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice}
    guided["grammar"] = req.guided_grammar
    found.extend((f"guided_{k}", k, v) for k, v in guided.items() if v is not None)
    return found


def _checked(param: str, kind: str, value: Any) -> str:
    """The spec's value text for ``kind``, after the checks this process can make."""
    if kind == "json":
        # Key order is kept: the output lists the properties in the schema's order.
        return json.dumps(check_json_schema(param, value), separators=(",", ":"))
    if kind == "json_object":
        return ""
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            raise APIError(400, f"{param}: not a valid regular expression: {exc}", param=param) from None
        return str(value)
    if kind == "choice":
        if not value:
            raise APIError(400, f"{param}: the choice list is empty", param=param)
        return json.dumps(list(value))
    if not str(value).strip():
        raise APIError(400, f"{param}: the grammar is empty", param=param)
    return str(value)


def check_json_schema(param: str, value: Any) -> dict[str, Any]:
    """The schema as a dict (it may come as JSON text); not valid JSON or not a valid schema is a 400."""
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"{param}: the schema is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(
            400, f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param
        )
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" at {where}" if where else ""
        raise APIError(400, f"{param}: not a valid JSON schema{at}: {exc.message}", param=param) from None
    return schema
