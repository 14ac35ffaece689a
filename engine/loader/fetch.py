"""``kvfleet fetch MODEL``: resolve a model into the kvfleet cache (fetch, convert) and say where it is.

Where it sits: beside ``kvfleet engine``; ``kvfleet up`` runs it once before it starts any
engine, so several engines never fetch the same model at once and an offline machine gets
one line saying why instead of a traceback per engine. Prints one JSON line
``{"model": ..., "path": ..., "served_name": ...}``. Torch-free (as the API process is).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvfleet.engine.loader.sources import resolve_model, served_name
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.tokenizer.hf import HFTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="'tiny', 'smollm2', a .gguf file, or a Hugging Face checkpoint folder")


def run(args: argparse.Namespace) -> int:
    try:
        path = resolve_model(args.model)
        if path.is_dir():
            HFTokenizer(path)  # what every engine would load first: a folder without one fails here, once
    except (ModelLoadError, OSError, ValueError) as exc:
        print(f"kvfleet fetch: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if not path.is_dir():
        print(
            f"kvfleet fetch: {args.model!r} is not a checkpoint folder, .gguf file, 'tiny' or 'smollm2'",
            file=sys.stderr,
        )
        return 2
    print(json.dumps({"model": args.model, "path": str(path), "served_name": served_name(args.model)}))
    return 0
