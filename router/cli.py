"""`kvfleet router`: not built yet; the router issue (#4) fills it in."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    print("kvfleet router: not yet built", file=sys.stderr)
    return 2
