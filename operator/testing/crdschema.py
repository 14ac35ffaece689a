"""What the API server does with a custom resource before storing it, for the tests.

Given a CRD from ``crds/``: apply the schema's defaults, refuse unknown fields (as
``kubectl apply`` does with strict field validation), validate the OpenAPI schema with
``jsonschema`` and evaluate every ``x-kubernetes-validations`` CEL rule with
``cel-python`` (the pure-Python CEL runtime). The emulator in ``apiserver.py`` runs this on
every create and patch, so a bad spec sent with the official client gets the 422 a real
server would send.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]  # operator/testing/ → the repository (a checkout: crds/, charts/)
CRD_DIR = ROOT / "crds"


def load_crds() -> dict[str, dict[str, Any]]:
    """Every CRD in crds/, by plural."""
    crds: dict[str, dict[str, Any]] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                crds[doc["spec"]["names"]["plural"]] = doc
    return crds


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


# Invariant: after apply_defaults, every absent property with a schema default is present,
# and defaults inside defaulted objects are applied too (parents before children), as the
# API server does; present values are never replaced.
def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def unknown_fields(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return []
    found: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if not path and key in ("apiVersion", "kind", "metadata"):
                continue
            sub = schema["properties"].get(key)
            if sub is None:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(sub, item, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


@functools.cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Messages of every CEL rule that does not hold, where its value is present."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        if not bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})):
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The object as the server would store it (defaults applied) and why it would refuse it."""
    schema = schema_of(crd)
    stored = apply_defaults(schema, copy.deepcopy(obj))
    errors = unknown_fields(schema, stored, "")
    errors = [f"unknown field {e!r}" for e in errors]
    # The structural schema reads as JSON Schema: int-or-string is spelt as its anyOf, x- keys are ignored.
    validator = jsonschema.Draft7Validator(schema)
    for err in sorted(validator.iter_errors(stored), key=lambda e: list(e.path)):
        where = "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in err.path)
        errors.append(f"{where or '<root>'}: {err.message}")
    if not errors:
        errors += cel_errors(schema, stored, "")
    return stored, errors
