"""`kvfleet operator`: its flags become one validated OperatorConfig; bad combinations are refused."""

from __future__ import annotations

import pytest

from kvfleet.cli import build_parser, main
from kvfleet.operator.cli import config_from_args
from kvfleet.operator.config import OperatorConfig


def parse(*argv: str) -> OperatorConfig:
    return config_from_args(build_parser(only="operator").parse_args(["operator", *argv]))


def test_flags_become_the_operator_config() -> None:
    config = parse("-n", "team-a", "--namespace", "team-b", "--engine-image", "eng:2", "--priority", "7")
    assert config == OperatorConfig(namespaces=("team-a", "team-b"), engine_image="eng:2", priority=7)
    assert parse("--all-namespaces", "--standalone").model_dump(
        include={"all_namespaces", "standalone", "namespaces"}
    ) == {
        "all_namespaces": True,
        "standalone": True,
        "namespaces": (),
    }


def test_replicas_without_a_priority_draw_distinct_ones() -> None:
    assert len({parse("-A").priority for _ in range(20)}) > 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "a", "-A"], "argument --all-namespaces/-A: not allowed with argument --namespace/-n"),
        ([], "one of the arguments --namespace/-n --all-namespaces/-A is required"),
        (
            ["-A", "--priority", "-1"],
            "kvfleet operator: priority: Input should be greater than or equal to 0",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["operator", *argv])
    except SystemExit as exit:  # argparse refuses before run()
        code = int(exit.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err
