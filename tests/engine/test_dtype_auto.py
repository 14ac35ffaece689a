"""``--dtype auto`` (engine/runner/dtype.py): every branch of the pure rule on made-up CPUs, what a
checkpoint is read as (config.json, a GGUF's tensor types, a quantized format), and the start-up line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.numpy import load_file

import kvfleet.engine.runner.dtype as dtype_module
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.native.bf16_gemm import load_bf16
from kvfleet.engine.kernels.native.cpu_features import AmxPermission, choose_cpu_paths, probe_cpu_paths
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.runner.dtype import CheckpointDtype, checkpoint_dtype, cpu_path, resolve_dtype
from kvfleet.engine.runner.model_runner import ModelRunner
from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.engine.testing.tiny_gguf import write_gguf

CPU, GPU = torch.device("cpu"), torch.device("cuda")
AVX2 = frozenset({"fpu", "avx", "fma", "avx2"})
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
XEON = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}
XEON_AMX = choose_cpu_paths(XEON, AmxPermission(True))
XEON_REFUSED = choose_cpu_paths(XEON, AmxPermission(False, "errno 22: Invalid argument"))
ZEN4_PATHS = choose_cpu_paths(ZEN4, None)
AVX2_PATHS = choose_cpu_paths(AVX2, None)
BF16, FP16, FP32 = CheckpointDtype("bfloat16"), CheckpointDtype("float16"), CheckpointDtype("float32")


def test_a_bf16_checkpoint_on_an_amx_xeon_is_served_in_bf16_and_the_line_says_why() -> None:
    choice = resolve_dtype("auto", BF16, CPU, XEON_AMX)
    assert choice.dtype == torch.bfloat16
    assert choice.line() == "dtype auto -> bfloat16: checkpoint bfloat16, cpu amx_bf16 (permission granted)"


def test_a_fp16_checkpoint_becomes_bf16_on_the_cpu() -> None:
    choice = resolve_dtype("auto", FP16, CPU, XEON_AMX)
    assert (choice.dtype, choice.reason) == (
        torch.bfloat16,
        "checkpoint float16, cpu amx_bf16 (permission granted)",
    )


def test_a_xeon_whose_amx_permission_was_refused_serves_bf16_on_avx512_bf16_and_names_the_refusal() -> None:
    choice = resolve_dtype("auto", BF16, CPU, XEON_REFUSED)
    assert choice.dtype == torch.bfloat16
    assert (
        choice.reason == "checkpoint bfloat16, cpu avx512_bf16 (amx_bf16 refused: errno 22: Invalid argument)"
    )


def test_an_epyc_with_avx512_bf16_and_no_amx_serves_a_16_bit_checkpoint_in_bf16() -> None:
    choice = resolve_dtype("auto", FP16, CPU, ZEN4_PATHS)
    assert (choice.dtype, choice.reason) == (torch.bfloat16, "checkpoint float16, cpu avx512_bf16")


def test_a_cpu_with_neither_bf16_path_serves_a_16_bit_checkpoint_in_float32_and_names_its_tier() -> None:
    for checkpoint in (BF16, FP16):
        choice = resolve_dtype("auto", checkpoint, CPU, AVX2_PATHS)
        assert choice.dtype == torch.float32
        assert choice.reason == f"{checkpoint}, but the cpu has no amx_bf16 or avx512_bf16 (best tier avx2)"


def test_a_float32_checkpoint_or_one_naming_no_dtype_stays_float32_even_on_amx() -> None:
    choice = resolve_dtype("auto", FP32, CPU, XEON_AMX)
    assert choice.line() == "dtype auto -> float32: checkpoint float32 kept, cpu path amx"
    unnamed = resolve_dtype("auto", CheckpointDtype(None), CPU, XEON_AMX)
    assert unnamed.line() == "dtype auto -> float32: checkpoint names no dtype kept, cpu path amx"


def test_a_quantized_checkpoint_keeps_float32_on_the_cpu_where_its_kernels_compute() -> None:
    for quantized in ("GGUF Q4_1 blocks", "compressed-tensors checkpoint", "--quantization int8"):
        choice = resolve_dtype("auto", CheckpointDtype(None, quantized), CPU, XEON_AMX)
        assert choice.dtype == torch.float32
        assert (
            choice.reason
            == f"checkpoint quantized ({quantized}): its CPU kernels compute in float32, cpu path amx"
        )


def test_an_explicit_dtype_is_served_as_asked_whatever_the_cpu() -> None:
    assert (
        resolve_dtype("float32", BF16, CPU, XEON_AMX).line()
        == "dtype float32 -> float32: asked, cpu path amx"
    )
    asked = resolve_dtype("bfloat16", FP32, CPU, AVX2_PATHS)  # kept; the runner warns
    assert asked.line() == "dtype bfloat16 -> bfloat16: asked, cpu path avx2"
    assert resolve_dtype("float16", FP32, GPU, None).dtype == torch.float16


def test_auto_on_a_gpu_is_bf16_as_before() -> None:
    choice = resolve_dtype("auto", FP32, GPU, None)
    assert choice.line() == "dtype auto -> bfloat16: checkpoint float32, device cuda: bfloat16 on a GPU"


def test_an_unknown_dtype_or_a_cpu_without_its_probe_is_refused_naming_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"dtype: 'float8' is not one of auto, float32, float16, bfloat16"):
        resolve_dtype("float8", BF16, CPU, XEON_AMX)
    with pytest.raises(ValueError, match=r"probe_cpu_paths"):
        resolve_dtype("auto", BF16, CPU, None)


def test_the_isa_path_named_is_the_bf16_path_or_else_the_vector_tier() -> None:
    assert [cpu_path(p) for p in (XEON_AMX, XEON_REFUSED, ZEN4_PATHS, AVX2_PATHS)] == [
        "amx",
        "avx512_bf16",
        "avx512_bf16",
        "avx2",
    ]


def tiny_with(folder: Path, **config: object) -> Path:
    """The tiny checkpoint copied to ``folder``, its config.json updated with ``config``."""
    shutil.copytree(ensure_tiny_model(), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype")} | config
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_a_checkpoint_s_dtype_is_read_from_config_json_under_either_key(tmp_path: Path) -> None:
    old = tiny_with(tmp_path / "old", torch_dtype="bfloat16")
    new = tiny_with(tmp_path / "new", dtype="float16")
    unnamed = tiny_with(tmp_path / "unnamed")
    assert checkpoint_dtype(str(old), old, None) == BF16
    assert checkpoint_dtype(str(new), new, None) == FP16
    assert checkpoint_dtype(str(unnamed), unnamed, None) == CheckpointDtype(None)
    assert checkpoint_dtype("tiny", ensure_tiny_model(), None) == FP32  # the tests' model stays float32


def test_a_quantized_checkpoint_or_flag_is_read_as_quantized(tmp_path: Path) -> None:
    int8 = tiny_with(
        tmp_path / "int8", torch_dtype="bfloat16", quantization_config={"quant_method": "compressed-tensors"}
    )
    assert checkpoint_dtype(str(int8), int8, None) == CheckpointDtype(None, "compressed-tensors checkpoint")
    assert checkpoint_dtype("tiny", ensure_tiny_model(), "int8") == CheckpointDtype(
        None, "--quantization int8"
    )


@pytest.mark.parametrize(
    ("qtype", "expected"),
    [
        (gguf.GGMLQuantizationType.F32, CheckpointDtype("float32")),
        (gguf.GGMLQuantizationType.F16, CheckpointDtype("float16")),
        (gguf.GGMLQuantizationType.BF16, CheckpointDtype("bfloat16")),
        (gguf.GGMLQuantizationType.Q8_0, CheckpointDtype(None, "GGUF Q8_0 blocks")),
        (gguf.GGMLQuantizationType.Q4_1, CheckpointDtype(None, "GGUF Q4_1 blocks")),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_a_gguf_is_read_by_its_layer_linears_tensor_type(
    tmp_path: Path, qtype: gguf.GGMLQuantizationType, expected: CheckpointDtype
) -> None:
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", weights, qtype=qtype)
    assert checkpoint_dtype(str(path), tmp_path, None) == expected


def start(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, paths: object
) -> ModelRunner:
    monkeypatch.setattr(dtype_module, "probe_cpu_paths", lambda: paths)
    config = EngineConfig(model=str(folder), device="cpu", num_kv_blocks=8)
    with caplog.at_level(logging.INFO, logger="kvfleet.engine.runner.model_runner"):
        return ModelRunner(config, folder)


def test_the_runner_serves_a_bf16_checkpoint_in_bf16_on_an_amx_xeon_and_logs_the_start_up_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = start(tiny_with(tmp_path / "bf16", torch_dtype="bfloat16"), monkeypatch, caplog, XEON_AMX)
    # served in bf16: the weights (layers/linear/bf16.py where its kernel builds here, else all-bf16 torch)
    native_bf16 = runner.quantization.method == "bf16"
    assert native_bf16 or load_bf16() is None
    assert runner.dtype == (torch.float32 if native_bf16 else torch.bfloat16)  # the compute dtype
    weights = [
        t for layer in runner.model.modules() for t in vars(layer).values() if isinstance(t, torch.Tensor)
    ]
    weights += list(runner.model.parameters())
    assert torch.bfloat16 in {t.dtype for t in weights}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
    assert lines == ["dtype auto -> bfloat16: checkpoint bfloat16, cpu amx_bf16 (permission granted)"]


def test_the_runner_serves_the_same_checkpoint_in_float32_on_an_avx2_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = start(tiny_with(tmp_path / "bf16", torch_dtype="bfloat16"), monkeypatch, caplog, AVX2_PATHS)
    assert runner.dtype == torch.float32
    assert (
        "dtype auto -> float32: checkpoint bfloat16, but the cpu has no amx_bf16 or avx512_bf16"
        in caplog.text
    )


def test_this_machine_keeps_the_float32_tiny_model_in_float32_and_names_its_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = start(ensure_tiny_model(), monkeypatch, caplog, probe_cpu_paths())
    assert runner.dtype == torch.float32
    assert (
        f"dtype auto -> float32: checkpoint float32 kept, cpu path {cpu_path(probe_cpu_paths())}"
        in caplog.text
    )


def test_a_f16_gguf_served_dequantized_is_served_in_bf16_on_an_amx_xeon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    path = write_gguf(tmp_path / "tiny-F16.gguf", weights, qtype=gguf.GGMLQuantizationType.F16)
    monkeypatch.setattr(dtype_module, "probe_cpu_paths", lambda: XEON_AMX)
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=8)
    with caplog.at_level(logging.INFO, logger="kvfleet.engine.runner.model_runner"):
        runner = ModelRunner(config, resolve_model(str(path)))
    assert runner.dtype == torch.bfloat16 and not runner.quantization.quantized
    assert "dtype auto -> bfloat16: checkpoint float16, cpu amx_bf16 (permission granted)" in caplog.text
