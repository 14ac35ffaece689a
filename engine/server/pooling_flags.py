"""The ``kvfleet engine`` flags of a pooling engine, named as vLLM names them: ``--runner``, ``--task``,
``--override-pooler-config``.

Where it sits: ``engine/server/flags.py`` adds this group to the engine's parser; ``engine/cli.py``
reads it back into ``EngineConfig.runner`` and ``override_pooler_config`` with :func:`runner_of`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_pooling_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--runner",
        default="generate",
        choices=["generate", "pooling"],
        help="What the model serves. 'pooling' serves POST /v1/embeddings only: each prompt's final hidden "
        "states pooled into one vector, with no KV cache and no decoding (engine/model/pooling.py).",
    )
    g.add_argument(
        "--task",
        default=None,
        choices=["generate", "embed"],
        help="vLLM's older name for the runner: 'embed' is --runner pooling, 'generate' --runner generate.",
    )
    g.add_argument(
        "--override-pooler-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='The pooler over what the checkpoint says, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
        "(pooling_type LAST, MEAN or CLS). The default is the sentence-transformers folder's, else LAST, normalised.",
    )


def runner_of(args: argparse.Namespace) -> str:
    """The runner the flags ask for (``--task`` wins where given, as it did in vLLM)."""
    task = getattr(args, "task", None)
    if task is not None:
        return "pooling" if task == "embed" else "generate"
    return str(getattr(args, "runner", "generate"))
