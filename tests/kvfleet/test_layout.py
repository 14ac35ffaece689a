"""The package layout of docs/architecture.md §2: the parts import as kvfleet.<part>, beside the standard library."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_standard_operator_module_and_the_kvfleet_operator_both_import() -> None:
    import operator

    import kvfleet.operator

    assert hasattr(operator, "itemgetter"), "the standard library's operator was shadowed"
    assert kvfleet.operator.__name__ == "kvfleet.operator"


def test_every_part_imports_under_the_kvfleet_name() -> None:
    import kvfleet.engine
    import kvfleet.router

    assert kvfleet.engine.__name__ == "kvfleet.engine"
    assert kvfleet.router.__name__ == "kvfleet.router"


def test_kvfleet_links_each_part_so_that_tools_reading_the_tree_find_its_imports() -> None:
    for part in ("engine", "router", "operator"):
        link = ROOT / "kvfleet" / part
        assert link.is_symlink() and os.readlink(link) == f"../{part}", f"kvfleet/{part} -> ../{part}"
        assert link.resolve() == (ROOT / part).resolve()


def _modules_loaded_by(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(out.split())


def test_the_router_and_operator_command_lines_never_load_torch() -> None:
    for command in ("router", "operator", "bench", "plan", "up"):
        loaded = _modules_loaded_by(f"from kvfleet.cli import build_parser; build_parser(only={command!r})")
        assert "torch" not in loaded, f"kvfleet {command} imported torch"


def test_the_help_lists_every_subcommand_of_the_design() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "--help"], check=True, capture_output=True, text=True
    ).stdout
    for command in ("up", "engine", "router", "operator", "bench", "plan"):
        assert command in out
