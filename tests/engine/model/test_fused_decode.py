"""A decode step through one native call (model/fused_layers.py, csrc/decode_layers.c) is the per-op path's.

The call runs the per-op path's own kernels in its order, so a step's logits and the K/V it
stores are equal bit for bit, on every checkpoint variant (GQA with llama3 rope, a sliding
window of 128 passed by a 140-token sequence, q/k/v biases with tied embeddings), with the
weights packed for the native GEMM and unpacked (the few-row kernel). A step it cannot
take exactly (a prefill chunk in it, LoRA, another attention backend, more than 16 rows on
unpacked weights) runs the per-op path.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.attention.torch_backend import TorchAttentionBackend
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.int8_linear import ONEDNN_MIN_ROWS
from kvfleet.engine.kernels.linear import TorchLinear
from kvfleet.engine.kernels.native.decode_layers import INT8_CHANNEL
from kvfleet.engine.kernels.native.int8_gemm import load_int8
from kvfleet.engine.kernels.native.quant_gemm import PATHS, load_quant
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS
from kvfleet.engine.kernels.packing.native import NativePackedWeight
from kvfleet.engine.kernels.quant_linear import dequantised
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.model.fused_layers import FusedLayers
from kvfleet.engine.runner.model_runner import ModelRunner
from kvfleet.engine.testing.tiny_gguf import write_gguf

pytestmark = pytest.mark.skipif(
    not NativePackedWeight.available(), reason="the native library does not build here"
)
BLOCK = 16
PROMPTS = (5, 30, 140)  # tokens already in the cache per sequence; the last passes mistral's window
TABLE = [[0] + [0] * 9, [1, 2] + [0] * 8, list(range(3, 13))]


def make_runner(folder: Path, packing: str) -> ModelRunner:
    common = dict(num_kv_blocks=16, block_size=BLOCK, attention_backend="cpu")
    if packing == "int8":
        return ModelRunner(EngineConfig(model=str(folder), quantization="int8", **common), folder)
    if packing.startswith("gguf-"):  # the tiny model in GGUF blocks, served --quantization gguf
        qtype = gguf.GGMLQuantizationType[packing.removeprefix("gguf-")]
        name = folder.parent / f"{folder.name}-{qtype.name}.gguf"
        source = write_gguf(name, tiny_weights(folder), qtype=qtype)
        config = EngineConfig(model=str(source), quantization="gguf", **common)
        return ModelRunner(config, resolve_model(str(source)))
    packed = dict(weight_packing="native") if packing == "native" else dict(prepack_weights=False)
    config = EngineConfig(
        model=str(folder), num_kv_blocks=16, block_size=BLOCK, attention_backend="cpu", **packed
    )
    return ModelRunner(config, folder)


def tiny_weights(folder: Path) -> dict[str, np.ndarray]:
    return load_file(str(folder / "model.safetensors"))


def meta_for(seqs: list[int], new: list[int]) -> AttentionMetadata:
    """Sequences ``seqs`` each adding ``new[i]`` tokens after their first PROMPTS[s] - new[i]."""
    slots, starts = [], [0]
    for s, n in zip(seqs, new, strict=True):
        for pos in range(PROMPTS[s] - n, PROMPTS[s]):
            slots.append(TABLE[s][pos // BLOCK] * BLOCK + pos % BLOCK)
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([TABLE[s] for s in seqs], dtype=torch.int32),
        seq_lens=torch.tensor([PROMPTS[s] for s in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(new),
        max_seq_len=max(PROMPTS[s] for s in seqs),
    )


def forward(
    runner: ModelRunner, seqs: list[int], new: list[int], sample: list[int] | None = None
) -> torch.Tensor:
    """The step's logits at rows ``sample`` (default: each sequence's last row)."""
    meta = meta_for(seqs, new)
    positions = torch.cat([torch.arange(PROMPTS[s] - n, PROMPTS[s]) for s, n in zip(seqs, new, strict=True)])
    ids = (positions * 7 + 3) % 250 + 3
    last = torch.tensor(meta.query_start_loc[1:].tolist()) - 1 if sample is None else torch.tensor(sample)
    with torch.inference_mode():
        return runner.model(ids, positions, runner.kv_caches, meta, runner.backend, last)


def spied_forward(
    runner: ModelRunner, seqs: list[int], new: list[int], sample: list[int] | None = None
) -> tuple[torch.Tensor, list[bool]]:
    """A step's logits, and for each FusedLayers.run call whether it took the step."""
    taken: list[bool] = []
    run = FusedLayers.run

    def spy(self: FusedLayers, *args: object) -> object:
        out = run(self, *args)  # type: ignore[arg-type]
        taken.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedLayers, "run", spy)
        return forward(runner, seqs, new, sample), taken


def caches(runner: ModelRunner) -> list[torch.Tensor]:
    return [c.clone() for c in runner.kv_caches]


def assert_one_call_is_the_per_op_step(
    runner: ModelRunner,
    seqs: list[int],
    new: list[int] | None = None,
    sample: list[int] | None = None,
    taken: bool = True,
) -> None:
    """The prompts (all but their last token) by the per-op path, then a step of ``seqs`` adding
    ``new`` tokens each (default: a decode step), sampling at rows ``sample`` (default: each
    sequence's last), by the per-op path and, from the same caches, by the one call (or, ``taken``
    False, the per-op path again, the one call refusing it): equal logits and K/V, bit for bit."""
    new = new or [1] * len(seqs)
    runner.model.use_fused_decode = False
    forward(runner, [0, 1, 2], [p - 1 for p in PROMPTS])
    before = caches(runner)
    per_op = forward(runner, seqs, new, sample)
    per_op_caches = caches(runner)
    for cache, saved in zip(runner.kv_caches, before, strict=True):
        cache.copy_(saved)
    runner.model.use_fused_decode = True
    one_call, calls = spied_forward(runner, seqs, new, sample)
    assert calls == [taken]
    assert torch.equal(one_call, per_op)
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, per_op_caches, strict=True))


@pytest.mark.parametrize("packing", ["native", "unpacked"])
@pytest.mark.parametrize("variant", ["tiny", "llama-gqa-llama3-sharded", "mistral-mqa", "qwen2-tied"])
@pytest.mark.parametrize("seqs", [[2], [0, 1, 2]], ids=["1-row", "3-rows"])
def test_a_decode_step_through_one_native_call_gives_the_per_op_logits_and_cache_bit_for_bit(
    variant: str, packing: str, seqs: list[int], tiny_dir: Path, hf_checkpoints: dict[str, Path]
) -> None:
    runner = make_runner(tiny_dir if variant == "tiny" else hf_checkpoints[variant], packing)
    fused = runner.model.fused_decode()
    assert fused is not None and fused.native.geometry.packed == (packing == "native")
    assert_one_call_is_the_per_op_step(runner, seqs)


# (sequences, new tokens each, sampling rows or None for each sequence's last): a stall-free step's
# decodes beside a chunk, chunks alone (one past mistral's window), a chunk that does not sample yet
MIXED = {
    "decodes-and-a-chunk": ([0, 1, 2], [1, 4, 1], None),
    "chunks-only": ([1, 2], [8, 20], None),
    "a-chunk-not-sampled": ([0, 1, 2], [1, 4, 1], [0, 5]),
}


@pytest.mark.parametrize("packing", ["native", "unpacked"])
@pytest.mark.parametrize("variant", ["tiny", "llama-gqa-llama3-sharded", "mistral-mqa", "qwen2-tied"])
@pytest.mark.parametrize("case", list(MIXED))
def test_a_step_with_prompt_chunks_through_one_native_call_gives_the_per_op_logits_and_cache_bit_for_bit(
    variant: str, packing: str, case: str, tiny_dir: Path, hf_checkpoints: dict[str, Path]
) -> None:
    runner = make_runner(tiny_dir if variant == "tiny" else hf_checkpoints[variant], packing)
    seqs, new, sample = MIXED[case]
    few_rows = sum(new) <= SKINNY_MAX_ROWS  # unpacked weights: the few-row kernel's rows only
    assert_one_call_is_the_per_op_step(runner, seqs, new, sample, taken=packing == "native" or few_rows)


def step_args(runner: ModelRunner, seqs: list[int], new: list[int] | None = None) -> tuple[object, ...]:
    new = new or [1] * len(seqs)
    meta = meta_for(seqs, new)
    rows = sum(new)
    positions = torch.zeros(rows, dtype=torch.int64)
    x = torch.zeros(rows, runner.model.config.hidden_size)
    rope = runner.model.model.rotary_emb(positions, meta, x.dtype)
    return x, rope, meta, runner.backend, torch.arange(len(seqs))


@pytest.mark.parametrize("packing", ["gguf-Q8_0", "gguf-Q4_1", "int8"])
@pytest.mark.parametrize(
    "step", [([2], None), ([0, 1, 2], None), ([0, 1, 2], [1, 4, 1])], ids=["1-row", "3-rows", "with-a-chunk"]
)
def test_a_quantised_step_through_one_native_call_gives_the_per_op_logits_and_cache_bit_for_bit(
    packing: str,
    step: tuple[list[int], list[int] | None],
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seqs, new = step
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_dir, tmp_path / "tiny")
    runner = make_runner(tmp_path / "tiny", packing)
    fused = runner.model.fused_decode()
    assert fused is not None
    native = load_int8() if packing == "int8" else load_quant()
    kind = INT8_CHANNEL if packing == "int8" else gguf.GGMLQuantizationType[packing[5:]].value
    assert {op.types for op in fused.native.operands} == {(kind,) * 4}
    assert PATHS[fused.native.geometry.quant_path] == native.path  # type: ignore[union-attr]
    assert_one_call_is_the_per_op_step(runner, seqs, new)
    assert runner.model.fused_decode() is fused


def test_a_quantised_layer_with_a_matmul_off_the_native_kernel_keeps_the_per_op_path(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_dir, tmp_path / "tiny")
    runner = make_runner(tmp_path / "tiny", "gguf-Q8_0")
    assert runner.model.fused_decode() is not None
    attn = runner.model.model.layers[1].self_attn
    assert attn.fixed is not None
    weight = dequantised(attn.fixed.output.weight)  # type: ignore[attr-defined]
    attn.fixed = attn.fixed._replace(
        output=TorchLinear(weight, None)
    )  # as a file holding o_proj in F32 loads
    runner.model._fused = None
    assert runner.model.fused_decode() is None


def test_an_int8_step_of_as_many_rows_as_the_per_op_path_sends_to_onednn_runs_the_per_op_path(
    tiny_dir: Path,
) -> None:
    runner = make_runner(tiny_dir, "int8")
    fused = runner.model.fused_decode()
    assert fused is not None and fused.native.geometry.max_rows == ONEDNN_MIN_ROWS - 1
    with torch.inference_mode():
        assert fused.step_inputs(*step_args(runner, [0, 1, 2])) is not None
        assert fused.step_inputs(*step_args(runner, [0] * ONEDNN_MIN_ROWS)) is None


def test_a_step_it_cannot_take_exactly_runs_the_per_op_path(tiny_dir: Path) -> None:
    native, unpacked = make_runner(tiny_dir, "native"), make_runner(tiny_dir, "unpacked")
    fused, fused_unpacked = native.model.fused_decode(), unpacked.model.fused_decode()
    assert fused is not None and fused_unpacked is not None
    with torch.inference_mode():
        assert fused.step_inputs(*step_args(native, [0, 1])) is not None
        assert fused.step_inputs(*step_args(native, [0, 1], new=[1, 4])) is not None  # a prefill chunk
        x, rope, meta, backend, rows = step_args(native, [0, 1])
        lora = dataclasses.replace(meta, lora=object())  # type: ignore[arg-type]
        assert fused.step_inputs(x, rope, lora, backend, rows) is None
        assert fused.step_inputs(x, rope, meta, TorchAttentionBackend(), rows) is None
        kept = fused.step_inputs(x, rope, meta, backend, rows[:1])  # a row that does not sample
        assert kept is not None and kept.keep is not None and kept.keep.tolist() == [0]
        x3, rope3, meta3, _, _ = step_args(native, [0, 1, 2])
        assert fused.step_inputs(x3, rope3, meta3, backend, torch.tensor([2, 0])) is None  # out of order
        backend._native_prefill = None  # type: ignore[attr-defined]  # chunks on SDPA (no AVX2/AVX-512 build)
        assert fused.step_inputs(*step_args(native, [0, 1], new=[1, 4])) is None
        assert fused.step_inputs(*step_args(native, [0, 1])) is not None
    assert fused.step_inputs(*step_args(native, [0, 1])) is None  # grad mode on
    many = [0] * 17
    with torch.inference_mode():
        assert fused.step_inputs(*step_args(native, many)) is not None
        assert fused_unpacked.step_inputs(*step_args(unpacked, many)) is None  # past the few-row kernel
        assert fused_unpacked.step_inputs(*step_args(unpacked, many[:16])) is not None


def test_turning_it_off_or_repacking_the_weights_is_seen(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir, "native")
    first = runner.model.fused_decode()
    assert first is not None and runner.model.fused_decode() is first
    runner.model.prepack("native")
    again = runner.model.fused_decode()
    assert again is not None and again is not first
    runner.model.use_fused_decode = False
    assert runner.model.fused_decode() is None


def test_a_model_in_another_dtype_never_builds_it(tiny_dir: Path) -> None:
    # bfloat16 on the CPU computes in float32 on bf16 weights (test_bf16_model.py): float16 stays float16
    config = EngineConfig(model=str(tiny_dir), num_kv_blocks=16, block_size=BLOCK, dtype="float16")
    assert ModelRunner(config, tiny_dir).model.fused_decode() is None
