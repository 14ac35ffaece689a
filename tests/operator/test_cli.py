"""`kvfleet operator`: its flags become one validated OperatorConfig; bad combinations are refused."""

from __future__ import annotations

import pytest

from kvfleet import __version__
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
        (["-A", "--metrics-from", "{nope"], "argument --metrics-from: not JSON: Expecting property name"),
        (["-A", "--metrics-from", "[1]"], "argument --metrics-from: must be a JSON object, got list"),
        (
            ["-A", "--metrics-from", '{"selector": {}}'],
            "--metrics-from: a NetworkPolicyPeer has namespaceSelector, podSelector or ipBlock, got ['selector']",
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


def test_engine_images_come_from_flags_or_the_environment_never_a_registry_in_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVFLEET_ENGINE_IMAGE_CPU", raising=False)
    monkeypatch.delenv("KVFLEET_ENGINE_IMAGE_CUDA", raising=False)
    bare = parse("-A")
    assert (bare.engine_image_for(0), bare.engine_image_for(1)) == (
        f"kvfleet-engine-cpu:{__version__}",
        f"kvfleet-engine-cuda:{__version__}",
    )
    monkeypatch.setenv("KVFLEET_ENGINE_IMAGE_CPU", "reg.example/kvfleet-engine-cpu:9")
    monkeypatch.setenv("KVFLEET_ENGINE_IMAGE_CUDA", "reg.example/kvfleet-engine-cuda:9")
    env = parse("-A")
    assert (env.engine_image_for(0), env.engine_image_for(2)) == (
        "reg.example/kvfleet-engine-cpu:9",
        "reg.example/kvfleet-engine-cuda:9",
    )
    flags = parse("-A", "--engine-image-cpu", "c:1", "--engine-image-cuda", "g:1")
    assert (flags.engine_image_for(0), flags.engine_image_for(8)) == ("c:1", "g:1")
    one = parse("-A", "--engine-image", "one:1", "--engine-image-cuda", "g:1")
    assert (one.engine_image_for(0), one.engine_image_for(8)) == ("one:1", "one:1")
