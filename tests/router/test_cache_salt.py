"""The tenant's cache salt at the router: what the engine is sent, and the prefix index keyed by it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvfleet.protocol import EngineLoad
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Endpoint, FleetView, Service
from kvfleet.router.errors import RouterError
from kvfleet.router.fleet import Fleet
from kvfleet.router.kube import service_of
from kvfleet.router.prefix import block_hashes, engine_cache_salt, shares_prefix_cache, tenant_cache_salt
from kvfleet.router.requests import COMPLETIONS, parse_request

from .conftest import FakeClock

A, B = "http://a", "http://b"
SYSTEM = "You are the assistant of a private project; answer in one line. " * 4


def test_no_client_salt_of_one_tenant_yields_another_tenants_salt() -> None:
    salts = {
        tenant_cache_salt("alice", None),
        tenant_cache_salt("bob", None),
        tenant_cache_salt("alice", "bob"),
        tenant_cache_salt("", "alice"),
        tenant_cache_salt("alic", "e"),
    }
    assert len(salts) == 5
    assert tenant_cache_salt("alice", "team-1") == tenant_cache_salt("alice", "team-1")


def test_a_shared_prefix_cache_passes_the_clients_salt_and_an_isolated_one_salts_the_tenant() -> None:
    assert engine_cache_salt("alice", None, shared=True) is None
    assert engine_cache_salt("alice", "mine", shared=True) == "mine"
    assert engine_cache_salt("alice", "mine", shared=False) == tenant_cache_salt("alice", "mine")


def test_the_inference_service_decides_sharing_and_the_router_flag_covers_the_rest() -> None:
    def service(routing: dict[str, object]) -> Service | None:
        return service_of({"metadata": {"name": "s"}, "spec": {"model": {"name": "m"}, "routing": routing}})

    assert shares_prefix_cache(service({"sharedPrefixCache": True}), default=False)
    assert not shares_prefix_cache(service({"sharedPrefixCache": False}), default=True)
    assert shares_prefix_cache(service({"policy": "kv-aware"}), default=True)
    assert not shares_prefix_cache(None, default=False)


def test_the_salt_is_set_on_the_body_sent_and_an_unchanged_body_is_sent_as_it_came() -> None:
    raw = b'{"model": "tiny", "prompt": "hi", "cache_salt": "mine"}'
    req = parse_request(COMPLETIONS, raw, 256)
    assert req.cache_salt == "mine" and req.upstream_content() is raw
    salt = tenant_cache_salt("alice", "mine")
    sent = json.loads(dataclasses.replace(req, cache_salt=salt).upstream_content())
    assert sent == {"model": "tiny", "prompt": "hi", "cache_salt": salt}


@pytest.mark.parametrize(("salt", "problem"), [("", "at least 1 character"), (7, "valid string")])
def test_a_bad_client_salt_is_a_400_naming_the_field_before_any_quota_is_spent(
    salt: object, problem: str
) -> None:
    raw = json.dumps({"model": "tiny", "prompt": "hi", "cache_salt": salt}).encode()
    with pytest.raises(RouterError) as info:
        parse_request(COMPLETIONS, raw, 256)
    assert (info.value.status, info.value.param) == (400, "cache_salt") and problem in info.value.message


def fleet_of(clock: FakeClock) -> Fleet:
    fleet = Fleet(RouterConfig(policy="prefix-aware"), clock)
    fleet.apply_view(FleetView((Endpoint(A), Endpoint(B))))
    for url in (A, B):
        fleet.observe(
            url, EngineLoad(model="tiny", kv_cache_usage=0.1, num_waiting=0, num_running=0, max_num_seqs=8)
        )
    return fleet


def test_prefix_aware_routing_follows_a_tenants_own_prefix_and_never_another_tenants(
    clock: FakeClock,
) -> None:
    fleet = fleet_of(clock)
    alice, bob = (block_hashes(SYSTEM, 32, tenant_cache_salt(t, None)) for t in ("alice", "bob"))
    first = fleet.place("tiny", alice)
    assert first is not None
    fleet.release(first)
    by_url = {c.url: c.prefix_blocks for c in fleet.candidates("tiny", alice)}
    assert by_url == {first.url: len(alice), ({A, B} - {first.url}).pop(): 0}
    assert {c.url: c.prefix_blocks for c in fleet.candidates("tiny", bob)} == {A: 0, B: 0}
    again = fleet.place("tiny", alice)
    assert again is not None and again.url == first.url
