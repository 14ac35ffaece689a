"""Grammar compilation never holds up the step loop: a constrained request waits unscheduled meanwhile.

A compile is held at a gate (the registered compiler for "grammar" waits on an Event), so
what happens while it runs is exact: the free request steps to its end, the constrained one
is neither scheduled nor answered; when the compile finishes, or its time runs out, its
verdict comes (``Engine.take_verdicts``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.outputs import ReqDelta
from kvfleet.engine.sampling_params import StructuredOutputSpec
from kvfleet.engine.structured import compiler

GRAMMAR = StructuredOutputSpec("grammar", 'root ::= "ok"')


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    opened = threading.Event()
    real = compiler.COMPILERS["grammar"]

    def held(c: object, value: str) -> object:
        opened.wait(30)
        return real(c, value)  # type: ignore[arg-type]

    monkeypatch.setitem(compiler.COMPILERS, "grammar", held)
    yield opened
    opened.set()


@pytest.fixture
def engine() -> Engine:
    return LLM("tiny", num_kv_blocks=64, max_model_len=128, max_num_seqs=4).engine


def run(engine: Engine, steps: int) -> list[ReqDelta]:
    return [d for _ in range(steps) for d in engine.step()]


def test_other_requests_keep_stepping_while_a_grammar_compiles(engine: Engine, gate: threading.Event) -> None:
    engine.add_request("constrained", "x", SamplingParams(max_tokens=8, structured=GRAMMAR))
    assert engine.verdict_deferred("constrained")
    engine.add_request("free", "x", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert not engine.verdict_deferred("free")
    deltas = run(engine, 5)
    assert [(d.request_id, d.finished) for d in deltas][-1] == ("free", True)
    assert {d.request_id for d in deltas} == {"free"}
    assert (engine.take_verdicts(), engine.scheduler.num_running, engine.stats().num_waiting) == ([], 0, 1)
    gate.set()
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert engine.take_verdicts() == [("constrained", None)]
    text = "".join(s.new_text for d in deltas for s in d.seqs)
    assert (text, deltas[-1].seqs[-1].finish_reason) == ("ok", "stop")


def test_a_grammar_not_compiled_in_time_is_refused_and_the_request_leaves(
    engine: Engine, gate: threading.Event
) -> None:
    assert engine.structured is not None
    engine.structured.compile_timeout_s = 0.05
    spec = StructuredOutputSpec("grammar", 'root ::= "ok"', source="structured_outputs.grammar")
    engine.add_request("slow", "x", SamplingParams(max_tokens=8, structured=spec))
    verdicts: list[tuple[str, object]] = []
    while not verdicts:  # each idle step waits up to 20 ms for the compile
        assert engine.step() == []
        verdicts = engine.take_verdicts()  # type: ignore[assignment]
    ((request_id, error),) = verdicts
    assert request_id == "slow" and not engine.has_unfinished_requests()
    assert (error.field, error.reason) == (  # type: ignore[attr-defined]
        "structured_outputs.grammar",
        "not compiled within 0.05 s (--structured-outputs-compile-timeout); simplify the schema or grammar",
    )


def test_an_abort_before_the_grammar_compiled_answers_the_verdict(
    engine: Engine, gate: threading.Event
) -> None:
    engine.add_request("gone", "x", SamplingParams(max_tokens=8, structured=GRAMMAR))
    final = engine.abort("gone")
    assert final is not None and final.seqs[0].finish_reason == "abort"
    ((request_id, error),) = engine.take_verdicts()
    assert (request_id, error is not None and error.reason) == ("gone", "aborted before its grammar compiled")
    assert not engine.has_unfinished_requests()


def test_a_spec_compiles_once_then_comes_from_the_cache(engine: Engine) -> None:
    assert engine.structured is not None
    spec = StructuredOutputSpec("regex", r"[0-9]{2}")
    params = SamplingParams(max_tokens=4, temperature=0.0, structured=spec)
    before = engine.structured.compiler.num_compiled
    outputs = LLM(engine=engine).generate(["a", "b", "c"], params)
    outputs += LLM(engine=engine).generate(["d"], params)
    assert engine.structured.compiler.num_compiled - before == 1
    assert all(len(o.outputs[0].text) == 2 and o.outputs[0].text.isdigit() for o in outputs)
