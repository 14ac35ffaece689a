"""Command-line flags → a process's one validated config object: the flags named as its fields.

Where it sits: ``kvfleet engine`` (``engine/cli.py``) and ``kvfleet router`` (``router/cli.py``) parse
their flags with argparse, then build their pydantic config from :func:`same_named` plus the few
fields whose flag is named or shaped otherwise (``--no-prefix-caching``, ``--engines a,b``). A new
field whose flag's dest is its name needs no line here or there.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel


def same_named(args: argparse.Namespace, config: type[BaseModel]) -> dict[str, Any]:
    """The parsed flags whose dest is a field of ``config``, by field name."""
    return {name: getattr(args, name) for name in config.model_fields if hasattr(args, name)}
