"""``kvfleet router --envoy-xds-port``: the flags, their errors, and the real process behind Envoy."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from kvfleet.router import cli
from kvfleet.router.config import RouterConfig
from kvfleet.router.gateway import xds
from kvfleet.router.gateway.config import GatewayConfig
from kvfleet.router.gateway.process import EnvoyProcess

from ..fakes import FakeEngine, served

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
    ]
    config = cli.config_from_args(
        parse(
            [*argv, "--envoy-admin-port", "9911", "--envoy-xds-host", "router.svc", "--max-queue-wait", "20"]
        )
    )
    assert isinstance(config, RouterConfig)
    assert config.envoy == GatewayConfig(
        xds_host="router.svc",
        xds_bind="0.0.0.0",
        xds_port=18000,
        listen_port=10080,
        admin_port=9911,
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
    ],
)
def test_bad_envoy_flags_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse(["--engines", "http://a:1", *argv])) == 2
    assert message in capsys.readouterr().err


async def test_the_router_process_writes_the_bootstrap_and_answers_envoy(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    (tmp_path / "tenants.yaml").write_text(f"tenants:\n  - tenant: cli\n    apiKey: {KEY}\n")
    gw = GatewayConfig(xds_port=free_port(), listen_port=free_port(), admin_port=free_port())
    engine = FakeEngine()
    async with served(engine.app(), free_port()) as url:
        command = [
            sys.executable,
            "-m",
            "kvfleet.cli",
            "router",
            "--engines",
            url,
            "--port",
            str(free_port()),
        ]
        command += ["--tenants", str(tmp_path / "tenants.yaml"), "--envoy-xds-port", str(gw.xds_port)]
        command += ["--envoy-port", str(gw.listen_port), "--envoy-admin-port", str(gw.admin_port)]
        command += ["--envoy-bootstrap", str(tmp_path / "envoy.json")]
        router = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            for _ in range(600):
                if (tmp_path / "envoy.json").exists() or router.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            assert json.loads((tmp_path / "envoy.json").read_text()) == xds.bootstrap_json(gw)
            envoy = EnvoyProcess(gw)
            await asyncio.to_thread(envoy.start)  # returns once the router's ADS has configured it
            try:
                client = openai.AsyncOpenAI(base_url=f"{envoy.url}/v1", api_key=KEY, max_retries=0)
                completion = await client.completions.create(model="tiny", prompt="hi")
            finally:
                await asyncio.to_thread(envoy.stop)
        finally:
            router.terminate()
            _, err = router.communicate(timeout=20)
    assert completion.choices[0].text == "Hello world"
    assert engine.received == [{"model": "tiny", "prompt": "hi"}], err.decode()[-2000:]
