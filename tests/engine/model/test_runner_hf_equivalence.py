"""The model runner, driven by hand-built scheduler plans, against transformers' greedy generate.

These run the torch backend; test_engine_hf_equivalence.py runs the same scenarios through the
whole engine on both backends (triton interpreted on the CPU)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.model.batch import flatten_plan
from kvfleet.engine.runner.model_runner import ModelRunner
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence

from .conftest import PROMPTS

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
NEW_TOKENS = 6


class HandScheduler:
    """Hands out block ids in order and builds plans the way the real scheduler would (a table in
    each of ``groups`` KV cache groups: engine/kv/groups.py)."""

    def __init__(self, groups: int = 1) -> None:
        self._next_block = itertools.count(1)  # block 0 stays unused: tables are padded with it
        self.groups = groups

    @classmethod
    def for_runner(cls, runner: ModelRunner) -> HandScheduler:
        return cls(len(runner.kv_layout.groups))

    def grow(self, seq: Sequence, upto: int) -> tuple[int, ...]:
        if len(seq.group_block_ids) < self.groups - 1:
            seq.group_block_ids = [[] for _ in range(self.groups - 1)]
        while len(seq.block_ids) * BLOCK < upto:
            for table in [seq.block_ids, *seq.group_block_ids]:
                table.append(next(self._next_block))
        return tuple(seq.block_ids)

    def entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        blocks = self.grow(seq, start + num_new)
        return ScheduledSeq(seq, start, num_new, blocks, tuple(map(tuple, seq.group_block_ids)))

    def decode_all(self, seqs: list[Sequence]) -> SchedulerPlan:
        return SchedulerPlan(tuple(self.entry(s, s.num_tokens - s.num_computed_tokens) for s in seqs))


def run_step(runner: ModelRunner, plan: SchedulerPlan) -> dict[int, int]:
    results = runner.execute(plan)
    for s in plan.scheduled:
        s.seq.num_computed_tokens = s.context_len
        if s.sample:
            s.seq.output_token_ids.append(results[s.seq.seq_id].token_id)
    return {seq_id: r.token_id for seq_id, r in results.items()}


def make_runner(folder: Path, num_blocks: int = 64, backend: str = "torch") -> ModelRunner:
    config = EngineConfig(
        model=str(folder), block_size=BLOCK, num_kv_blocks=num_blocks, attention_backend=backend
    )
    return ModelRunner(config, folder)


def new_seq(prompt: list[int]) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=list(prompt), params=GREEDY)


def prefill_logits(
    model: Path, folder: Path, prompts: list[list[int]], num_kv_blocks: int
) -> tuple[torch.Tensor, str]:
    """The last-position logits of every prompt, one prefill step (torch attention), and the loader
    that served them: what the GGUF tests hold a converted checkpoint's to its reference's."""
    config = EngineConfig(
        model=str(model), block_size=4, num_kv_blocks=num_kv_blocks, attention_backend="torch"
    )
    runner = ModelRunner(config, folder)
    sched = HandScheduler.for_runner(runner)
    batch = flatten_plan(sched.decode_all([new_seq(p) for p in prompts]), runner.block_size, runner.device)
    with torch.inference_mode():
        logits = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.meta, runner.backend, batch.sample_rows
        )
    return logits, runner.quantization.loader


@pytest.fixture(params=["llama-gqa-llama3-sharded", "mistral-mqa", "qwen2-tied", "tiny"])
def checkpoint(request: Any, hf_checkpoints: dict[str, Path], tiny_dir: Path) -> Path:
    return tiny_dir if request.param == "tiny" else hf_checkpoints[request.param]


def test_a_batch_of_mixed_prompt_lengths_decodes_the_same_greedy_tokens_as_transformers(
    checkpoint: Path, hf_greedy: Any
) -> None:
    runner, sched = make_runner(checkpoint), HandScheduler()
    seqs = [new_seq(p) for p in PROMPTS]
    for _ in range(NEW_TOKENS):
        run_step(runner, sched.decode_all(seqs))
    assert [s.output_token_ids for s in seqs] == [hf_greedy(checkpoint, p, NEW_TOKENS) for p in PROMPTS]


def test_a_prompt_prefilled_in_two_chunks_beside_a_decoding_sequence_matches_transformers(
    hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints["llama-gqa-llama3-sharded"]
    runner, sched = make_runner(folder), HandScheduler()
    long, short = new_seq(PROMPTS[2]), new_seq(PROMPTS[0])
    run_step(runner, sched.decode_all([short]))
    first = run_step(runner, SchedulerPlan((sched.entry(long, 13), sched.entry(short, 1))))
    assert set(first) == {short.seq_id}  # a mid-prompt chunk samples nothing
    assert long.num_computed_tokens == 13 and long.output_token_ids == []
    for _ in range(NEW_TOKENS):
        run_step(runner, sched.decode_all([long, short]))
    assert long.output_token_ids == hf_greedy(folder, PROMPTS[2], NEW_TOKENS)
    assert short.output_token_ids == hf_greedy(folder, PROMPTS[0], NEW_TOKENS + 2)


def test_a_second_sequence_reading_the_first_ones_full_blocks_as_a_prefix_matches_transformers(
    hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints["qwen2-tied"]
    runner, sched = make_runner(folder), HandScheduler()
    first = new_seq(PROMPTS[2])
    run_step(runner, sched.decode_all([first]))
    shared = first.block_ids[:3]  # 12 prompt tokens in full blocks
    second_prompt = PROMPTS[2][:12] + [7, 8, 9, 10, 11]
    second = new_seq(second_prompt)
    second.block_ids = list(shared)
    second.num_computed_tokens = 12
    for _ in range(NEW_TOKENS):
        run_step(runner, sched.decode_all([second, first]))
    assert second.block_ids[:3] == shared
    assert second.output_token_ids == hf_greedy(folder, second_prompt, NEW_TOKENS)
    assert first.output_token_ids == hf_greedy(folder, PROMPTS[2], NEW_TOKENS + 1)


def test_prefill_logits_are_within_1e_4_of_transformers(checkpoint: Path, hf_model: Any) -> None:
    runner, sched = make_runner(checkpoint), HandScheduler()
    seqs = [new_seq(p) for p in PROMPTS]
    batch = flatten_plan(sched.decode_all(seqs), runner.block_size, runner.device)
    with torch.inference_mode():  # the logits of every row that samples, before the sampler
        ours = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.meta, runner.backend, batch.sample_rows
        )
    model = hf_model(checkpoint)
    with torch.no_grad():
        theirs = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_kv_cache_is_one_tensor_per_layer_of_the_documented_shape(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir, num_blocks=10)
    assert runner.num_kv_blocks == 10
    # one block past the scheduler's 10: the decode path's null block, written by padding rows only
    assert [tuple(c.shape) for c in runner.kv_caches] == [(2, 10 + 1, BLOCK, 2, 32)] * 4
    assert runner.kv_caches[0].dtype == torch.float32


def test_kv_cache_memory_in_bytes_sets_the_block_count(tiny_dir: Path) -> None:
    # tiny: 2 (K and V) x 4 layers x 2 kv heads x 32 dims x 4 bytes = 2048 bytes per token
    config = EngineConfig(model=str(tiny_dir), block_size=16, kv_cache_memory=2048 * 16 * 7 + 100)
    assert ModelRunner(config, tiny_dir).num_kv_blocks == 7


def test_llama3_rope_scaling_gives_the_inverse_frequencies_transformers_uses(
    hf_checkpoints: dict[str, Path], hf_model: Any
) -> None:
    folder = hf_checkpoints["llama-gqa-llama3-sharded"]
    ours = make_runner(folder).model.model.rotary_emb.inv_freq
    theirs = hf_model(folder).model.rotary_emb.inv_freq
    torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
    unscaled = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(ours, unscaled)  # the scaling really changes the low frequencies


def test_a_sliding_window_is_attention_per_layer_not_a_cap_on_the_context_length(
    hf_checkpoints: dict[str, Path],
) -> None:
    runner = make_runner(hf_checkpoints["mistral-mqa"])
    assert (runner.model_config.layer_windows, runner.max_model_len) == ((128, 128), 256)
    windows = [
        layer.self_attn.sliding_window
        for layer in make_runner(hf_checkpoints["qwen2-window"]).model.model.layers
    ]
    assert windows == [None, 6]


def test_a_prefill_steps_last_layer_runs_its_mlp_at_the_sampling_rows_only(tiny_dir: Path) -> None:
    runner, sched = make_runner(tiny_dir), HandScheduler()
    batch = flatten_plan(sched.decode_all([new_seq(p) for p in PROMPTS]), runner.block_size, runner.device)
    layers = runner.model.model.layers
    seen: dict[str, list[int]] = {"first": [], "last": []}
    hooks = [
        layers[0].mlp.register_forward_hook(lambda m, args, out: seen["first"].append(args[0].shape[0])),
        layers[-1].mlp.register_forward_hook(lambda m, args, out: seen["last"].append(args[0].shape[0])),
    ]
    args = (batch.input_ids, batch.positions, runner.kv_caches, batch.meta, runner.backend)
    with torch.inference_mode():
        pruned = runner.model(*args, batch.sample_rows)
        every_row = runner.model(*args, torch.arange(batch.input_ids.shape[0]))
    for hook in hooks:
        hook.remove()
    rows = sum(len(p) for p in PROMPTS)
    assert seen == {"first": [rows, rows], "last": [len(PROMPTS), rows]}
    torch.testing.assert_close(pruned, every_row[batch.sample_rows], atol=1e-5, rtol=1e-5)
