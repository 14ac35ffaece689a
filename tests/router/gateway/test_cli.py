"""``kvfleet router --envoy-xds-port``: the flags, their errors, and the real process behind Envoy."""

from __future__ import annotations

import argparse

import pytest

from kvfleet.router import cli
from kvfleet.router.config import RouterConfig
from kvfleet.router.gateway_config import GatewayConfig

KEY = "sk-cli-0123456789"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_envoy_flags_become_the_configs_gateway_part() -> None:
    argv = [
        "--engines",
        "http://a:1",
        "--host",
        "0.0.0.0",
        "--envoy-xds-port",
        "18000",
        "--envoy-port",
        "10080",
        "--envoy-listen-host",
        "0.0.0.0",
    ]
    config = cli.config_from_args(
        parse(
            [
                *argv,
                "--envoy-admin-port",
                "9911",
                "--envoy-xds-host",
                "router.svc",
                "--max-queue-wait",
                "20",
                "--envoy-retries",
                "1",
            ]  # fmt: skip
        )
    )
    assert isinstance(config, RouterConfig)
    assert config.envoy == GatewayConfig(
        xds_host="router.svc",
        xds_bind="0.0.0.0",
        xds_port=18000,
        listen_host="0.0.0.0",
        listen_port=10080,
        admin_port=9911,
        num_retries=1,
        message_timeout_s=25.0,
    )


def test_without_an_xds_port_there_is_no_gateway() -> None:
    config = cli.config_from_args(parse(["--engines", "http://a:1"]))
    assert isinstance(config, RouterConfig)
    assert config.envoy is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--envoy-bootstrap", "envoy.json"], "--envoy-bootstrap needs --envoy-xds-port"),
        (["--envoy-xds-port", "10000"], "xds_port=10000 is also listen_port"),
        (["--envoy-xds-port", "8080"], "--port 8080 is also one of Envoy's ports"),
        (["--envoy-xds-port", "70000"], "less than or equal to 65535"),
        (
            ["--envoy-xds-port", "18000", "--envoy-retries", "9"],
            "num_retries\n  Input should be less than or equal to 8",
        ),
    ],
)
def test_bad_envoy_flags_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse(["--engines", "http://a:1", *argv])) == 2
    assert message in capsys.readouterr().err
