"""Random JSON schemas for the structured-output property tests and bench: nested objects, arrays, enums, bounded numbers, optional keys.

Every generated schema bounds its outputs (strings and arrays have a maximum length), so that
a random model's constrained output can finish within a small token budget.
"""

from __future__ import annotations

import random
from typing import Any


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema (the top level of a structured output), nested up to three levels."""
    return _object(rng, depth)


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "enum", "boolean", "null"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": _value(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "enum":
        pool = ["red", "green", "blue", 1, 2, 3.5, None, True, "a b", "é"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    return {"type": kind}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "size", "tags", "items", "ok", "value", "kind", "x"], rng.randint(1, 3))
    props = {name: _value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
