"""What the scheduler does to a sequence's KV between steps, for the KV manager's tests: a
sequence of tokens, its computed tokens advanced and registered, one decode step."""

from __future__ import annotations

from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence


def seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams())


def computed(kv: KVCacheManager, s: Sequence, num_tokens: int) -> None:
    """What Scheduler.update does after a step: advance and register the full blocks."""
    s.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(s)


def decode(kv: KVCacheManager, s: Sequence, token: int) -> list[int] | None:
    """One decode step: a new token, its slot, computed."""
    s.output_token_ids.append(token)
    new = kv.allocate_slots(s, 1)
    computed(kv, s, s.num_tokens)
    return new
