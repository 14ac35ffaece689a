"""Structured outputs' cost: decode steps of constrained rows against free rows, and a cold schema's TTFT.

    OMP_NUM_THREADS=2 python bench/serving/structured_outputs.py [--model smollm2] [--rows 32] [--steps 20]

1. Step time: ``rows`` requests decode together, all free (greedy) or all constrained by a JSON
   schema (each row its own schema; a string with a large minLength keeps every row inside its
   grammar for the whole run), alternating in rounds on one engine. The grammar's share is the
   time the step spent filling and applying the token bitmasks and advancing the matchers
   (``StructuredOutputs.times``) over the step's wall time.
2. Time to first token of one request on an idle engine: free, with a schema never seen
   (compiled on the thread pool while the request waits), and with the same schema again (cached).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvfleet.engine.client.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputSpec

PROMPT = "Write a JSON record about a dragon and the knight who met it. "


def record_schema(tag: int) -> str:
    """A realistic nested schema (tag makes it distinct: a cold compile each time)."""
    props = {
        f"title_{tag}": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 800, "maximum": 1500},
        "mood": {"enum": ["calm", "angry", "sleepy"]},
        "knight": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 16, "maximum": 70},
            },
            "required": ["name", "age"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "story": {"type": "string", "minLength": 100_000},
    }
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def step_times(llm: LLM, params: list[SamplingParams], steps: int) -> tuple[float, float, float]:
    """Median step seconds over ``steps`` decode steps, the grammar's median seconds per step and the
    median of its share of a step.

    Per-step shares, not total over total: on a shared machine a step now and then takes 10x
    longer (another process had the cores), and a median of ratios is not moved by it."""
    engine = llm.engine
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", PROMPT, p)
    while (
        engine.scheduler.waiting
        or engine.stats().num_waiting
        or any(not s.output_token_ids for s in engine.scheduler.running)
    ):
        engine.step()  # compiles and prompts
    for _ in range(3):
        engine.step()
    times = engine.structured.times  # type: ignore[union-attr]
    walls, grammar, shares = [], [], []
    for _ in range(steps):
        before = times.mask_s + times.accept_s
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        grammar.append(times.mask_s + times.accept_s - before)
        shares.append(grammar[-1] / walls[-1])
    assert engine.scheduler.num_running == len(params), "a row finished during the timed steps"
    for i in range(len(params)):
        engine.abort(f"s{i}")
    return statistics.median(walls), statistics.median(grammar), statistics.median(shares)


def ttft(llm: LLM, params: SamplingParams, request_id: str) -> float:
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(request_id, PROMPT, params)
    while not any(d.request_id == request_id and d.seqs and d.seqs[0].new_token_ids for d in engine.step()):
        pass
    elapsed = time.perf_counter() - start
    engine.abort(request_id)
    return elapsed


def report_steps(results: dict[str, list[tuple[float, float, float]]], rows: int) -> None:
    free_s = statistics.median(w for w, _, _ in results["free"])
    con_s = statistics.median(w for w, _, _ in results["constrained"])
    grammar_s = statistics.median(g for _, g, _ in results["constrained"])
    share = statistics.median(sh for _, _, sh in results["constrained"])
    print(f"  step, {rows} free rows:        {free_s * 1e3:8.2f} ms")
    print(f"  step, {rows} constrained rows: {con_s * 1e3:8.2f} ms  ({con_s / free_s:.3f}x)")
    print(
        f"  grammar per constrained step (bitmask fill + apply + matcher advance): {grammar_s * 1e3:.2f} ms"
    )
    print(f"  grammar's share of a constrained step (median of per-step shares): {share:.1%}")


def report_ttft(llm: LLM) -> None:
    ttft(llm, SamplingParams(max_tokens=4, temperature=0.0), "warm-up")
    base, cold, warm = [], [], []
    for i in range(7):  # interleaved, so that a noisy moment of the machine hits all three alike
        spec = StructuredOutputSpec("json", record_schema(1000 + i))
        p = SamplingParams(max_tokens=4, temperature=0.0, structured=spec)
        base.append(ttft(llm, SamplingParams(max_tokens=4, temperature=0.0), f"free{i}"))
        cold.append(ttft(llm, p, f"cold{i}"))
        warm.append(ttft(llm, p, f"warm{i}"))
    print("time to first token, one request on an idle engine (median of 7):")
    print(f"  free:                 {statistics.median(base) * 1e3:8.2f} ms")
    print(f"  schema never seen:    {statistics.median(cold) * 1e3:8.2f} ms  (compiled off the step loop)")
    print(f"  same schema, cached:  {statistics.median(warm) * 1e3:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=max(args.rows, 8))
    free = [SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)] * args.rows
    constrained = [
        SamplingParams(
            max_tokens=10_000, temperature=0.0, structured=StructuredOutputSpec("json", record_schema(i))
        )
        for i in range(args.rows)
    ]
    step_times(llm, free[:4], 3)  # warm-up: first steps pay for lazy packing and the native kernel
    results: dict[str, list[tuple[float, float, float]]] = {"free": [], "constrained": []}
    for _ in range(args.rounds):
        results["free"].append(step_times(llm, free, args.steps))
        results["constrained"].append(step_times(llm, constrained, args.steps))
    print(
        f"model {args.model}, {args.rows} rows decoding, {args.steps} steps x {args.rounds} rounds (medians)"
    )
    report_steps(results, args.rows)
    report_ttft(llm)


if __name__ == "__main__":
    main()
