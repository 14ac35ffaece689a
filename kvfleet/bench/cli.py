"""`kvfleet bench`: not built yet; the engine-server issue (#3) fills it in."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    print("kvfleet bench: not yet built", file=sys.stderr)
    return 2
