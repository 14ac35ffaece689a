"""The tenants file, the config and the command line: good input read exactly, bad input named."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvfleet.router import cli
from kvfleet.router.config import ConfigError, RouterConfig, load_tenants_file
from kvfleet.router.tenants import TenantRegistry

GOOD = """
tenants:
  - tenant: alice
    apiKey: sk-alice-0123456789
    models: [tiny]
    limits: {requestsPerMinute: 60, tokensPerMinute: 10000, maxConcurrentRequests: 4,
             maxQueuedRequests: 8, maxTokensPerRequest: 2048}
    priority: 1
    weight: 2
  - tenant: bob
    apiKey: sk-bob-0123456789
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_a_tenants_file_reads_as_tenant_quota_specs(tmp_path: Path) -> None:
    alice, bob = load_tenants_file(write(tmp_path, GOOD))
    assert (alice.tenant, alice.models, alice.priority, alice.weight) == ("alice", ["tiny"], 1, 2.0)
    limits = alice.limits
    assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent_requests) == (
        60,
        10000,
        4,
    )
    assert (limits.max_queued_requests, limits.max_tokens_per_request) == (8, 2048)
    assert (bob.models, bob.limits.requests_per_minute, bob.weight) == ([], None, 1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants: 3", "expected a mapping with a 'tenants:' list"),
        (
            "tenants:\n  - {tenant: a, apiKey: short}",
            r"tenants\[0\]\.apiKey: String should have at least 8 characters",
        ),
        (
            "tenants:\n  - {tenant: a, apiKey: sk-0123456789, limits: {requestsPerMinute: 0}}",
            r"tenants\[0\]\.limits\.requestsPerMinute: Input should be greater than or equal to 1",
        ),
        (
            "tenants:\n  - {tenant: a, apiKey: sk-0123456789, limits: {rpm: 5}}",
            r"tenants\[0\]\.limits\.rpm: Extra inputs",
        ),
        (
            "tenants:\n  - {tenant: a, apiKey: sk-0123456789, weight: 0}",
            r"tenants\[0\]\.weight: Input should be greater",
        ),
        (
            "tenants:\n  - {tenant: a, apiKey: sk-0123456789}\n  - {tenant: a, apiKey: sk-9876543210}",
            "tenant 'a' appears more than once",
        ),
        (
            "tenants:\n  - {tenant: a, apiKey: sk-0123456789}\n  - {tenant: b, apiKey: sk-0123456789}",
            "two tenants share one apiKey",
        ),
        ("tenants: [", "tenants file"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_the_entry_and_field(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_tenants_file(write(tmp_path, text))


def test_engine_urls_must_be_http() -> None:
    with pytest.raises(ValueError, match="engine URL 'localhost:8000' must start with http://"):
        RouterConfig(engines=["localhost:8000"])


def test_the_registry_finds_tenants_by_key_only(tmp_path: Path) -> None:
    entries = load_tenants_file(write(tmp_path, GOOD))
    registry = TenantRegistry((e.api_key, e) for e in entries)
    found = registry.authenticate("sk-bob-0123456789")
    assert found is not None and found.name == "bob"
    assert registry.authenticate("sk-bob-012345678") is None
    assert registry.authenticate("") is None
    assert registry.names() == ["alice", "bob"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_command_line_builds_one_config(tmp_path: Path) -> None:
    args = parse(
        [
            "--engines",
            "http://a:1, http://b:2/",
            "--tenants",
            str(write(tmp_path, GOOD)),
            "--policy",
            "kv-aware",
            "--redis",
            "redis://r:6379/0",
            "--no-admission",
            "--slo-ttft-ms",
            "500",
        ]
    )
    config = cli.config_from_args(args)
    assert isinstance(config, RouterConfig)
    assert config.engines == ["http://a:1", "http://b:2"]
    assert [t.tenant for t in config.tenants] == ["alice", "bob"]
    assert (config.policy, config.redis_url, config.admission, config.slo.ttft_ms) == (
        "kv-aware",
        "redis://r:6379/0",
        False,
        500.0,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "http://a:1", "--policy", "fastest"], "unknown routing policy 'fastest'"),
        ([], "give --engines URL,... or --kubernetes"),
        (["--engines", "ftp://a"], "must start with http://"),
    ],
)
def test_bad_flags_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse(argv)) == 2
    assert message in capsys.readouterr().err
