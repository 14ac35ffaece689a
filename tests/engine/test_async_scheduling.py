"""--async-scheduling (engine/core/async_scheduling.py) on the real runner and the tiny checkpoint: the same
greedy tokens, text and finish reasons as one step at a time, through stop strings, stop tokens and
max_tokens finishing mid-batch, preemption, prefix-cache hits, chunked prefill, padded decode steps,
per-step streams, aborts and requests whose sampling reads the host (logprobs, penalties)."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine import cli
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.outputs import ReqDelta
from kvfleet.engine.sampling_params import RequestOutputKind, SamplingParams
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN
from kvfleet.engine.testing.tiny import ensure_tiny_model

from .conftest import FakeRunner, fold

Outputs = dict[str, list[tuple[list[int], str, str | None, Any]]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("kvfleet-cache"))


def engine(tiny: Path, async_scheduling: bool, **config: Any) -> Engine:
    config = {"max_num_seqs": 8, "max_num_batched_tokens": 48, "num_kv_blocks": 48, "block_size": 4} | config
    return Engine(EngineConfig(model=str(tiny), seed=0, async_scheduling=async_scheduling, **config))


def requests(seed: int = 0, n: int = 14, **params: Any) -> list[tuple[str, list[int], SamplingParams]]:
    """Mixed prompt and output lengths; every third prompt shares a 12-token prefix (prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(12)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(2, 30))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0, ignore_eos=True)
        out.append((f"r{i}", (shared + prompt) if i % 3 == 0 else prompt, sp))
    return [(rid, p, dataclasses.replace(sp, **params)) for rid, p, sp in out]


def run(
    eng: Engine, reqs: list[tuple[str, list[int], SamplingParams]], abort: dict[int, str] | None = None
) -> Outputs:
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    deltas: list[ReqDelta] = []
    step = 0
    while eng.has_unfinished_requests():
        if abort and step in abort and (d := eng.abort(abort[step])) is not None:
            deltas.append(d)
        deltas.extend(eng.step())
        step += 1
        assert step < 500
    for d in deltas:
        assert all(PLACEHOLDER_TOKEN not in s.new_token_ids for s in d.seqs), "a placeholder was emitted"
    assert eng.stats().kv_cache_usage == 0.0 and not eng.scheduler.running
    return {
        rid: [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
        for rid, o in fold(deltas).items()
    }


def test_async_greedy_tokens_equal_one_step_at_a_time_through_preemption_prefix_hits_and_chunks(
    tiny: Path,
) -> None:
    reqs = requests()
    sync_engine, async_engine = engine(tiny, False), engine(tiny, True)
    assert async_engine._async is not None and sync_engine._async is None
    assert run(async_engine, reqs) == run(sync_engine, reqs)
    stats = async_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_async_padded_decode_steps_feed_the_tokens_through_the_static_buffers(tiny: Path) -> None:
    reqs = requests(seed=1)
    sizes = {"cuda_graph_sizes": [1, 2, 4, 8], "num_kv_blocks": 200}
    assert run(engine(tiny, True, **sizes), reqs) == run(engine(tiny, False, **sizes), reqs)


def test_stop_strings_and_stop_tokens_finishing_mid_batch_drop_the_extra_row(tiny: Path) -> None:
    base = requests(seed=2, n=6)
    plain = run(engine(tiny, False, num_kv_blocks=200), base)
    reqs = []
    for rid, prompt, params in base:  # stop inside each output: a string for some, a token for others
        tokens, text = plain[rid][0][0], plain[rid][0][1]
        if len(tokens) < 4:
            continue
        stop = {"stop": (text[2:4],)} if int(rid[1:]) % 2 else {"stop_token_ids": (tokens[2],)}
        reqs.append((rid, prompt, dataclasses.replace(params, **stop)))
    want = run(engine(tiny, False, num_kv_blocks=200), reqs)
    assert {o[0][2] for o in want.values()} == {"stop"}
    for kind in RequestOutputKind:
        kinded = [(r, p, dataclasses.replace(s, output_kind=kind)) for r, p, s in reqs]
        assert run(engine(tiny, True, num_kv_blocks=200), kinded) == want


def test_an_abort_while_a_step_is_pending_frees_its_blocks_and_emits_no_placeholder(tiny: Path) -> None:
    reqs = requests(seed=3, n=8, max_tokens=20)
    sync_out = run(engine(tiny, False), reqs, abort={4: "r1", 9: "r5"})
    async_out = run(engine(tiny, True), reqs, abort={4: "r1", 9: "r5"})
    for rid in ("r1", "r5"):  # one step behind: what it had read when aborted
        tokens = async_out.pop(rid)[0][0]
        assert tokens == sync_out.pop(rid)[0][0][: len(tokens)]
    assert async_out == sync_out


def test_requests_that_read_the_host_run_one_step_at_a_time_with_the_same_outputs(tiny: Path) -> None:
    reqs = requests(seed=4, n=8)
    reqs[2] = (reqs[2][0], reqs[2][1], dataclasses.replace(reqs[2][2], logprobs=2))
    reqs[5] = (reqs[5][0], reqs[5][1], dataclasses.replace(reqs[5][2], repetition_penalty=1.3))
    got, want = run(engine(tiny, True), reqs), run(engine(tiny, False), reqs)
    assert without_logprobs(got) == without_logprobs(want)
    # Logprobs to float32 rounding: the two engines' batches differ where a pending step was read
    # alone, and the GEMM packer chosen at load need not give a row the same bits in another batch.
    got_lp, want_lp = got["r2"][0][3], want["r2"][0][3]
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got_lp] == [
        (lp.token_id, [t for t, _ in lp.top]) for lp in want_lp
    ]
    assert [lp.logprob for lp in got_lp] == pytest.approx([lp.logprob for lp in want_lp], abs=1e-4)


def without_logprobs(outs: Outputs) -> dict[str, list[tuple[list[int], str, str | None]]]:
    return {
        rid: [(tokens, text, finish) for tokens, text, finish, _ in choices] for rid, choices in outs.items()
    }


def test_a_runner_that_cannot_launch_keeps_the_engine_synchronous(make_engine: Any) -> None:
    eng = make_engine(async_scheduling=True)
    assert eng._async is None and isinstance(eng.runner, FakeRunner)
    eng.add_request("r", "a", SamplingParams(max_tokens=3))
    assert [o.seqs[0].new_text for o in eng.step()] == ["b"]


def test_the_async_scheduling_flag_sets_the_config_field_and_defaults_off() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.engine_config(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert cli.engine_config(parser.parse_args([])).async_scheduling is False


def test_seeded_random_samples_and_n_2_forks_draw_the_same_tokens_with_async_scheduling(tiny: Path) -> None:
    reqs = [(r, p, dataclasses.replace(s, n=2, temperature=0.7, seed=5)) for r, p, s in requests(seed=7, n=6)]
    outs = run(engine(tiny, True, num_kv_blocks=200), reqs)
    assert outs == run(engine(tiny, False, num_kv_blocks=200), reqs)
    assert all(len(choices) == 2 for choices in outs.values())


def test_an_abort_before_the_first_token_is_read_drops_the_pending_row_and_the_rest_go_on(tiny: Path) -> None:
    eng = engine(tiny, True)
    eng.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    eng.add_request("kept", [5, 6, 8], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert eng.step() == []  # the prompts launched, their first tokens not read
    aborted = eng.abort("gone")
    assert aborted is not None and aborted.seqs[0].new_token_ids == [] and aborted.finished
    deltas = [d for _ in range(8) for d in eng.step()]
    assert {d.request_id for d in deltas} == {"kept"} and deltas[-1].finished
    alone = engine(tiny, False)
    alone.add_request("kept", [5, 6, 8], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    want = [t for _ in range(5) for d in alone.step() for t in d.seqs[0].new_token_ids]
    assert [t for d in deltas for t in d.seqs[0].new_token_ids] == want
    assert eng.stats().kv_cache_usage == 0.0
