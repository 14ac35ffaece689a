"""The engine's one quantization config (engine/layers/linear/config.py): inferred from the
checkpoint as vLLM infers it (a GGUF file in its blocks, a compressed-tensors or fp8 config.json in
its scheme, anything else float), ``--quantization`` overriding where it can, a combination that
cannot be served refused naming it, and the runner resolving it (and refusing what it cannot
serve) before it starts a tensor-parallel worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.numpy import load_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.layers.linear import QuantizationConfig, resolve_quantization
from kvfleet.engine.layers.linear.config import FLOAT
from kvfleet.engine.layers.linear.gguf_blocks import QuantEmbedding
from kvfleet.engine.loader.gguf_loader import gguf_model
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.runner.model_runner import ModelRunner
from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.engine.testing.tiny_gguf import write_gguf

CPU, F32 = torch.device("cpu"), torch.float32


def ct_config(kind: str) -> dict[str, object]:
    weights = {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}


def folder_with(tmp_path: Path, quantization_config: dict[str, object] | None) -> Path:
    """The tiny checkpoint's folder whose config.json carries ``quantization_config`` (weights as they are)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(ensure_tiny_model(), folder)
    config = json.loads((folder / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_gguf(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    weights = load_file(str(ensure_tiny_model() / "model.safetensors"))
    return write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", weights, qtype=qtype)


def resolve(
    flag: str | None, model: Path | str, folder: Path | None = None, **kw: object
) -> QuantizationConfig:
    device, dtype = kw.get("device", CPU), kw.get("dtype", F32)
    assert isinstance(device, torch.device) and isinstance(dtype, torch.dtype)
    gguf = gguf_model(str(model), flag)  # what the runner hands the config of --model
    return resolve_quantization(flag, folder or Path(model), device, dtype, gguf)


def test_a_plain_checkpoint_is_float_and_loads_as_before() -> None:
    quant = resolve(None, ensure_tiny_model())
    assert quant == FLOAT and not quant.quantized and quant.loader == "float"
    assert quant.prepacks and quant.linear_method(F32).prepacks
    assert gguf_model("smollm2", None) is None  # the alias serves its float conversion unless asked


def test_a_quantised_gguf_model_is_served_in_its_blocks_without_the_flag(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)
    for model in (path, path.parent):  # the file, or a folder holding one
        quant = resolve(None, model, ensure_tiny_model())
        assert (quant.method, quant.stored, quant.loader, quant.gguf_file) == ("gguf", "gguf", "gguf", path)
        assert quant.source == f"GGUF file {path.name}"


def test_a_float_gguf_or_one_where_its_kernel_cannot_run_is_dequantised(tmp_path: Path) -> None:
    assert resolve(None, tiny_gguf(tmp_path, gguf.GGMLQuantizationType.F32), ensure_tiny_model()) == FLOAT
    q8 = tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)
    assert resolve(None, q8, ensure_tiny_model(), dtype=torch.bfloat16) == FLOAT
    assert resolve(None, q8, ensure_tiny_model(), device=torch.device("cuda")) == FLOAT


@pytest.mark.parametrize("kind", ["int", "float"])
def test_a_compressed_tensors_config_is_served_in_its_scheme(kind: str, tmp_path: Path) -> None:
    quant = resolve(None, folder_with(tmp_path, ct_config(kind)))
    scheme = "int8" if kind == "int" else "fp8"
    assert (quant.stored, quant.loader) == (scheme, "quantized") and not quant.quantizes_floats
    assert quant.method == ("int8" if kind == "int" else "float")  # fp8 on the CPU: dequantised at load
    assert not quant.prepacks  # the quantised loader resolves every matmul itself
    assert quant.source == f"compressed-tensors {scheme} checkpoint"


def test_an_fp8_config_is_detected_and_block_scales_refused(tmp_path: Path) -> None:
    quant = resolve(None, folder_with(tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic"}))
    assert (quant.stored, quant.method, quant.loader) == ("fp8", "float", "quantized")
    assert quant.source == "fp8 checkpoint (quant_method fp8)"
    blocks = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ModelLoadError, match=r"weight_block_size \[128, 128\].*not served"):
        resolve(None, folder_with(tmp_path / "b", blocks))


def test_the_flag_overrides_a_float_checkpoint_and_a_gguf_model(tmp_path: Path) -> None:
    quant = resolve("int8", ensure_tiny_model())
    assert (quant.method, quant.stored, quant.source) == ("int8", "float", "--quantization int8")
    assert quant.quantizes_floats and quant.loader == "quantized"
    path = tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)
    dequantised = resolve("int8", path, ensure_tiny_model())  # the GGUF's floats, quantised to int8
    assert (dequantised.method, dequantised.stored) == ("int8", "float")
    asked = resolve("gguf", path, ensure_tiny_model())
    assert (asked.method, asked.gguf_file, asked.source) == ("gguf", path, "--quantization gguf")
    int8 = resolve("int8", folder_with(tmp_path, ct_config("int")))
    assert (int8.method, int8.stored) == ("int8", "int8")  # the flag names what the checkpoint is


def test_a_combination_that_cannot_be_served_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="--quantization gguf serves a GGUF checkpoint"):
        resolve("gguf", ensure_tiny_model())
    with pytest.raises(ModelLoadError, match="--quantization int8 asked of a compressed-tensors fp8"):
        resolve("int8", folder_with(tmp_path, ct_config("float")))
    with pytest.raises(ModelLoadError, match="--quantization fp8 needs a GPU"):
        resolve("fp8", ensure_tiny_model())
    with pytest.raises(ModelLoadError, match="'awq' is not served"):
        resolve(None, folder_with(tmp_path / "awq", {"quant_method": "awq"}))


def test_gguf_blocks_off_the_cpu_or_in_another_dtype_are_refused_naming_their_source(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)
    quant = resolve("gguf", path, ensure_tiny_model())
    with pytest.raises(
        ModelLoadError, match=r"'gguf' \(--quantization gguf\) runs on the CPU kernels in float32"
    ):
        quant.check_serves(torch.device("cuda"), F32)
    with pytest.raises(ModelLoadError, match="got device cpu, dtype torch.bfloat16"):
        quant.check_serves(CPU, torch.bfloat16)
    quant.check_serves(CPU, F32)
    FLOAT.check_serves(torch.device("cuda"), torch.bfloat16)


class Started(Exception):
    pass


def gguf_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A quantised GGUF ``--model`` and the folder the runner is handed (its conversion)."""
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)
    return str(path), resolve_model(str(path))


@pytest.mark.parametrize(
    ("checkpoint", "want"),
    [
        ("compressed-tensors int8", ("int8", "int8", "compressed-tensors int8 checkpoint")),
        ("fp8", ("float", "fp8", "fp8 checkpoint (quant_method fp8)")),  # fp8 on the CPU: dequantised
        ("gguf", ("gguf", "gguf", "GGUF file tiny-Q8_0.gguf")),  # its blocks, on every rank
    ],
)
def test_the_runner_resolves_the_checkpoints_quantization_before_it_starts_a_worker(
    checkpoint: str, want: tuple[str, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if checkpoint == "gguf":
        model, folder = gguf_conversion(tmp_path, monkeypatch)
    else:
        fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        folder = folder_with(tmp_path, fp8 if checkpoint == "fp8" else ct_config("int"))
        model = str(folder)
    seen: list[QuantizationConfig] = []

    def start(self: ModelRunner, backend: str) -> None:
        seen.append(self.quantization)  # what rank 0 hands every worker
        raise Started

    monkeypatch.setattr(ModelRunner, "_start_workers", start)
    with pytest.raises(Started):
        ModelRunner(EngineConfig(model=model, tensor_parallel_size=2, num_kv_blocks=8), folder)
    assert [(q.method, q.stored, q.source) for q in seen] == [want]


def test_a_gguf_model_without_the_flag_runs_in_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))  # the conversion's cache
    path = tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(model=str(path), num_kv_blocks=16)
    runner = llm.engine.runner
    assert (runner.quantization.method, runner.quantization.gguf_file) == ("gguf", path)
    assert isinstance(runner.model.model.embed_tokens, QuantEmbedding) and runner.weight_packing is None
    (out,) = llm.generate([[256, 72, 101]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3


def test_every_quantization_flag_takes_lora_and_several_ranks() -> None:
    """gguf was refused both until its loader sharded (LoRA wraps every method's kernel)."""
    for flag in ("int8", "fp8", "gguf"):
        config = EngineConfig(model="tiny", quantization=flag, enable_lora=True, tensor_parallel_size=2)
        assert (config.quantization, config.lora_enabled, config.tensor_parallel_size) == (flag, True, 2)
