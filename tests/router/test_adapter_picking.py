"""Adapter-aware picking on crafted loads: residency steers placement within the load bound, a free
slot comes next, and the fleet sends an adapter only to the engines configured with it."""

from __future__ import annotations

from kvfleet.protocol import EngineLoad, LoraLoad
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Endpoint, FleetView
from kvfleet.router.fleet import Fleet
from kvfleet.router.picker import Candidate, PickContext, adapter_score, choose, policy
from kvfleet.router.prefix import block_hashes, cache_namespace

from .conftest import FakeClock

CTX = PickContext(weights=RouterConfig().picker_weights, max_engine_queue=4, saturation_kv_usage=0.95)
A, B, C = "http://a", "http://b", "http://c"


def lora_load(
    running: int = 0, resident: tuple[str, ...] = (), busy: tuple[str, ...] = (), slots: int = 2
) -> EngineLoad:
    return EngineLoad(
        model="base",
        kv_cache_usage=0.1,
        num_waiting=0,
        num_running=running,
        max_num_seqs=16,
        lora=LoraLoad(max_loras=slots, resident=list(resident), running=list(busy)),
    )


def cand(url: str, load: EngineLoad, adapter: str = "sql", sent: frozenset[str] = frozenset()) -> Candidate:
    return Candidate(url, load, in_flight=load.num_running, adapter=adapter, adapters_sent=sent)


def pick(*cands: Candidate) -> str | None:
    choice = choose(list(cands), policy("adapter-aware"), CTX, 0)
    return choice.url if choice else None


def test_the_engine_holding_the_adapter_wins_over_an_idler_one_without_it() -> None:
    holder = cand(A, lora_load(running=3, resident=("sql",), busy=("sql",)))
    idle = cand(B, lora_load(running=0))
    assert pick(idle, holder) == A
    assert adapter_score(holder, CTX) >= 4.0 > 3.0 >= adapter_score(idle, CTX) >= 2.0


def test_the_holder_is_left_once_it_is_over_the_load_bound() -> None:
    holder = cand(A, lora_load(running=12, resident=("sql",), busy=("sql",)))
    others = [cand(B, lora_load(running=0)), cand(C, lora_load(running=1))]
    assert pick(holder, *others) == B


def test_without_a_holder_the_least_loaded_engine_with_a_free_slot_wins() -> None:
    full = cand(A, lora_load(running=0, resident=("x", "y"), busy=("x", "y")))  # both slots busy
    free = cand(B, lora_load(running=2, resident=("x",), busy=("x",)))  # one slot empty
    idle_victim = cand(C, lora_load(running=3, resident=("x", "y"), busy=("x",)))  # y idle: evictable
    assert pick(full, free, idle_victim) == B
    assert pick(full, idle_victim) == C
    assert not full.has_adapter_slot() and free.has_adapter_slot() and idle_victim.has_adapter_slot()


def test_an_adapter_sent_since_the_last_load_counts_as_held_and_as_taking_a_slot() -> None:
    just_sent = cand(A, lora_load(running=1), sent=frozenset({"sql"}))
    assert just_sent.holds_adapter()
    other = cand(
        A, lora_load(running=1, resident=("x",), busy=("x",), slots=2), adapter="y", sent=frozenset({"sql"})
    )
    assert not other.has_adapter_slot()  # x resident and sql on its way fill both slots


def test_the_prefix_index_keys_each_adapter_apart_and_the_base_model_apart_from_both() -> None:
    text = "same system prompt " * 20
    base, sql, chat = (block_hashes(text, 64, cache_namespace(adapter=a)) for a in (None, "sql", "chat"))
    assert len(base) == len(sql) == len(chat) > 0
    assert not set(base) & set(sql) and not set(sql) & set(chat)
    assert block_hashes(text, 64, cache_namespace(adapter="sql")) == sql
    assert cache_namespace("salt", None) != cache_namespace(None, "salt")


def fleet_with_adapters(clock: FakeClock) -> Fleet:
    fleet = Fleet(RouterConfig(), clock)
    fleet.apply_view(FleetView((Endpoint(A), Endpoint(B), Endpoint(C))))
    fleet.observe(A, lora_load(resident=("sql",)))
    fleet.observe(B, lora_load(resident=("chat",)))
    fleet.observe(C, lora_load())
    fleet.observe_adapters(A, frozenset({"sql", "chat"}))
    fleet.observe_adapters(B, frozenset({"sql", "chat"}))
    fleet.observe_adapters(C, frozenset({"chat"}))
    return fleet


def test_the_fleet_sends_an_adapter_only_to_engines_configured_with_it_and_prefers_residency(
    clock: FakeClock,
) -> None:
    fleet = fleet_with_adapters(clock)
    assert fleet.models() == {"base", "sql", "chat"}
    assert [e.url for e in fleet.ready_engines("sql")] == [A, B]
    assert fleet.policy_name("sql") == "adapter-aware" and fleet.policy_name("base") == "default"
    placed = [fleet.place("sql", ()) for _ in range(3)]
    assert [p.url for p in placed if p] == [A, A, A]
    chat = fleet.place("chat", ())
    assert chat is not None and chat.url == B
    assert fleet.place("legal", ()) is None


def test_an_engine_reporting_an_unknown_resident_adapter_has_its_list_read_again(clock: FakeClock) -> None:
    fleet = fleet_with_adapters(clock)
    engine = fleet.engines[C]
    assert not engine.adapters_stale(clock(), 10.0)
    fleet.observe(C, lora_load(resident=("legal",)))  # loaded at run time through /v1/load_lora_adapter
    assert engine.adapters_stale(clock(), 10.0)
    clock.advance(11.0)
    fleet.observe(C, lora_load())
    assert engine.adapters_stale(clock(), 10.0)


def test_a_released_adapter_request_wakes_the_queues_of_every_model_its_engine_serves(
    clock: FakeClock,
) -> None:
    fleet = fleet_with_adapters(clock)
    woken: list[str] = []
    fleet.on_change = woken.append
    placed = fleet.place("sql", ())
    assert placed is not None
    fleet.release(placed)
    assert woken == ["base", "chat", "sql"]
