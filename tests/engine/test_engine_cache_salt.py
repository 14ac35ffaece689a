"""Engine.add_request: a request's cache_salt keeps its prefix-cache blocks to requests of the same salt.

Block size 4, the fake runner of conftest: ``RanEntry.start`` is where a sequence's first
step started (the prompt tokens found in the prefix cache), ``block_ids`` its block table.
"""

from collections.abc import Callable

import pytest

from kvfleet.engine.core.engine import Engine, RequestError
from kvfleet.engine.sampling_params import SamplingParams

from .conftest import RanEntry
from .test_engine import run

MakeEngine = Callable[..., Engine]
PROMPT = "abcdefghij"  # 10 tokens: two full blocks can be cached


def first_step(
    engine: Engine, request_id: str, salt: str | None, prompt: str = PROMPT, n: int = 1
) -> RanEntry:
    """Run the request to its end; its first sequence's first step."""
    before = len(engine.runner.steps)  # type: ignore[attr-defined]
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, n=n, cache_salt=salt))
    run(engine)
    steps = engine.runner.steps[before:]  # type: ignore[attr-defined]
    return next(e for step in steps for e in step if e.request_id == request_id and e.index == 0)


def test_a_prompt_is_reused_from_the_cache_only_by_requests_of_the_same_salt(make_engine: MakeEngine) -> None:
    engine = make_engine()
    a = first_step(engine, "a", "tenant-a")
    b = first_step(engine, "b", "tenant-b")
    unsalted = first_step(engine, "c", None)
    again = first_step(engine, "d", "tenant-a")
    assert (a.start, a.block_ids) == (0, (0, 1, 2))
    assert (b.start, unsalted.start) == (0, 0)
    assert not set(b.block_ids[:2]) & set(a.block_ids[:2])
    assert not set(unsalted.block_ids[:2]) & (set(a.block_ids[:2]) | set(b.block_ids[:2]))
    assert (again.start, again.block_ids[:2]) == (8, (0, 1))


def test_unsalted_requests_share_their_prefix_as_before(make_engine: MakeEngine) -> None:
    engine = make_engine()
    first = first_step(engine, "a", None)
    second = first_step(engine, "b", None)
    assert (second.start, second.block_ids[:2]) == (8, first.block_ids[:2])


def test_every_sample_of_an_n_request_caches_its_blocks_under_the_request_salt(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    # A prompt shorter than a block: no sample forks from a cached block, each hashes its own chain.
    engine.add_request("f", "abc", SamplingParams(n=3, max_tokens=6, ignore_eos=True, cache_salt="t"))
    run(engine)  # each sample is "abc" + "defghi": two full blocks, computed in the salt "t"
    whole = "abcdefghij"
    assert first_step(engine, "other", None, whole).start == 0
    assert first_step(engine, "other-salt", "u", whole).start == 0
    assert first_step(engine, "same", "t", whole).start == 8


@pytest.mark.parametrize("salt", ["", 7])
def test_a_salt_that_is_not_a_non_empty_string_is_refused_naming_the_field(salt: object) -> None:
    with pytest.raises(RequestError, match="cache_salt: must be a non-empty string") as err:
        SamplingParams(cache_salt=salt)  # type: ignore[arg-type]
    assert err.value.field == "cache_salt"
