"""Adapter slots and the prefix cache: more adapters than slots, and KV blocks kept apart per adapter."""

from __future__ import annotations

from pathlib import Path

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.plan import SchedulerPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[256, *range(10 + i, 30 + i)] for i in range(6)]
LONG = [256, *range(60, 100)]  # 41 tokens: two full 16-token blocks and a partial one


def build(lora_base: Path, adapters: dict[str, Path], **config: object) -> LLM:
    modules = {name: str(path) for name, path in adapters.items()}
    return LLM(
        model=str(lora_base), attention_backend="torch", num_kv_blocks=128, lora_modules=modules, **config
    )


def watch(llm: LLM) -> tuple[list[SchedulerPlan], list[list[str]]]:
    """Every plan the runner executes, and the adapters resident on the device after each."""
    plans: list[SchedulerPlan] = []
    resident: list[list[str]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(plan: SchedulerPlan) -> dict[int, SampleResult]:
        plans.append(plan)
        out = execute(plan)
        resident.append(list(runner.lora.resident))  # type: ignore[attr-defined]
        return out

    runner.execute = spy  # type: ignore[method-assign]
    return plans, resident


def test_more_adapters_than_slots_all_complete_with_the_outputs_of_enough_slots(
    lora_base: Path, adapters: dict[str, Path]
) -> None:
    names = [*adapters, None, *adapters, None]
    loras = [names[i % len(names)] for i in range(len(PROMPTS) * 2)]
    prompts = PROMPTS * 2
    roomy = build(lora_base, adapters, max_loras=3)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY, lora=loras)]
    tight = build(lora_base, adapters, max_loras=1, max_cpu_loras=1)  # one slot, one adapter in memory
    plans, resident = watch(tight)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY, lora=loras)]
    assert got == want
    assert max(len(r) for r in resident) == 1
    per_step = [{s.seq.lora_name for s in p.scheduled} - {None} for p in plans]
    assert max(len(a) for a in per_step) == 1
    assert any(
        None in {s.seq.lora_name for s in p.scheduled} and a for p, a in zip(plans, per_step, strict=True)
    ), "base-model requests share steps with the one resident adapter"
    stats = tight.engine.stats().lora
    assert stats is not None and sum(stats.evictions.values()) >= 2 and sum(stats.loads.values()) >= 3
    assert stats.requests == {name: loras.count(name) for name in adapters} == dict.fromkeys(adapters, 3)
    assert stats.generation_tokens == dict.fromkeys(adapters, 3 * GREEDY.max_tokens)
    assert stats.prompt_tokens == {name: 3 * len(PROMPTS[0]) for name in adapters}


def test_the_same_prompt_shares_kv_blocks_under_one_adapter_and_never_across_adapters(
    lora_base: Path, adapters: dict[str, Path]
) -> None:
    first, second = list(adapters)[:2]
    llm = build(lora_base, adapters, max_loras=2)
    plans, _ = watch(llm)

    def full_blocks(lora: str | None, start: int) -> set[tuple[int, ...]]:
        return {s.block_ids[:2] for p in plans[start:] for s in p.scheduled if s.seq.lora_name == lora}

    (warm,) = llm.generate([LONG], GREEDY, lora=first)
    warm_blocks = full_blocks(first, 0)
    start = len(plans)
    again, other, base = llm.generate([LONG] * 3, GREEDY, lora=[first, second, None])
    assert again.num_cached_tokens == 32 and other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert full_blocks(first, start) == warm_blocks, "the same adapter reuses the blocks it computed"
    (again_ids,) = full_blocks(first, start)
    (other_ids,) = full_blocks(second, start)
    (base_ids,) = full_blocks(None, start)
    assert not set(again_ids) & set(other_ids) and not set(again_ids) & set(base_ids)
    assert not set(other_ids) & set(base_ids)
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids
