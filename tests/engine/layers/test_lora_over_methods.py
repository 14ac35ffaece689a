"""LoRA wraps every linear method: an adapter's delta is added to the output of whatever kernel ran
the matmul (``lora/context.py``'s hook after each of a block's two matmuls), so a quantised model
takes adapters as a float one does.

For a compressed-tensors int8 checkpoint and a GGUF file (both detected, no flag), under one
LoRA-enabled engine: base requests get the tokens of the same checkpoint served without LoRA, and
adapter requests the tokens of that checkpoint with each matmul wrapped in a plain torch reference
(its kernel's output plus ``x Aᵀ B`` per targeted projection, B scaled as PEFT scales it), equal up
to float summation order (the greedy tokens are compared). ``--quantization gguf`` with an adapter
also gives the adapter's tokens over the same weights dequantised to float32 (the file's conversion)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.kernels.native.int8_gemm import load_int8, quantize_per_channel
from kvfleet.engine.kernels.native.quant_gemm import load_quant
from kvfleet.engine.kernels.operand import NativeOperand
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.lora.config import read_adapter_config
from kvfleet.engine.lora.context import DOWN_PROJ, GATE_UP, O_PROJ, QKV
from kvfleet.engine.lora.weights import LoraWeights, load_weights
from kvfleet.engine.model.llama import DecoderLayer, LlamaForCausalLM
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.engine.testing.tiny_gguf import write_gguf

from ..lora.conftest import make_adapter

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, *range(40, 69)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
QUANT_TIE = 0.05  # nats: top-2 logprobs closer than this may swap under int8 activations per 32

pytestmark = pytest.mark.skipif(
    load_int8() is None or load_quant() is None, reason="the native library does not build here"
)


def int8_checkpoint(folder: Path) -> Path:
    """The tiny checkpoint as llm-compressor saves W8A8 int8: per-channel int8 linears, detected."""
    shutil.copytree(ensure_tiny_model(), folder)
    config = json.loads((folder / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": weights}},
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors, out = load_file(str(folder / "model.safetensors")), {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            q = quantize_per_channel(t)
            out[name], out[name + "_scale"] = q.qweight, q.scale[:, None]
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"))
    return folder


def gguf_checkpoint(folder: Path) -> Path:
    folder.mkdir()
    weights = {k: v.numpy() for k, v in load_file(str(ensure_tiny_model() / "model.safetensors")).items()}
    return write_gguf(folder / "tiny-Q8_0.gguf", weights, qtype=gguf.GGMLQuantizationType.Q8_0)


@dataclass(frozen=True)
class WithAdapter:
    """The torch reference: ``kernel(x)`` plus ``(x Aᵀ) B`` on each targeted projection's columns."""

    kernel: object
    layer: int
    modules: tuple[str, ...]
    widths: dict[str, int]
    adapter: LoraWeights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x).clone()  # type: ignore[operator]
        col = 0
        for module in self.modules:
            key = (self.layer, module)
            if key in self.adapter.a:
                out[:, col : col + self.widths[module]] += (x @ self.adapter.a[key].t()) @ self.adapter.b[key]
            col += self.widths[module]
        return out

    def native_operand(self) -> NativeOperand | None:
        return None


def wrap_with_adapter(model: LlamaForCausalLM, adapter: LoraWeights) -> None:
    c = model.config
    widths = {
        "q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
        "v_proj": c.num_kv_heads * c.head_dim, "o_proj": c.hidden_size, "gate_proj": c.intermediate_size,
        "up_proj": c.intermediate_size, "down_proj": c.hidden_size,
    }  # fmt: skip
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        for block, (inputs, output) in ((layer.self_attn, (QKV, O_PROJ)), (layer.mlp, (GATE_UP, DOWN_PROJ))):
            fixed = block.fixed
            assert fixed is not None  # a quantised loader's matmuls
            block.fixed = Matmuls(
                WithAdapter(fixed.inputs, i, inputs, widths, adapter),
                WithAdapter(fixed.output, i, output, widths, adapter),
            )
    model._fused = None


@pytest.mark.parametrize("fmt", ["int8", "gguf"])
def test_an_adapter_over_a_quantised_method_is_its_kernel_plus_the_torch_delta(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    model = str(int8_checkpoint(tmp_path / "ct") if fmt == "int8" else gguf_checkpoint(tmp_path / "g"))
    adapter = make_adapter(ensure_tiny_model(), tmp_path / "adapter", 4, 8, False, TARGETS, seed=1)
    lora = LLM(model, num_kv_blocks=64, lora_modules={"a": str(adapter)})
    assert lora.engine.runner.quantization.method == fmt
    plain = LLM(model, num_kv_blocks=64)
    reference = LLM(model, num_kv_blocks=64)
    config = read_adapter_config(str(adapter), max_rank=16)
    weights = load_weights("a", str(adapter), config, lora.engine.runner.model_config)
    wrap_with_adapter(reference.engine.runner.model, weights)

    def tokens(llm: LLM, name: str | None) -> list[list[int]]:
        outs = llm.generate(PROMPTS, GREEDY, lora=name) if name else llm.generate(PROMPTS, GREEDY)
        return [list(o.outputs[0].token_ids) for o in outs]

    base = tokens(plain, None)
    assert tokens(lora, None) == base  # the wrapping leaves base requests alone
    with_adapter = tokens(lora, "a")
    assert with_adapter == tokens(reference, None)
    assert with_adapter != base, "the adapter changes the tokens: the test can tell them apart"


def test_an_adapter_over_gguf_blocks_gives_the_adapter_over_their_dequantised_floats_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quantization gguf`` with LoRA (once refused) against the same adapter over the file's
    float32 conversion (the same weights, dequantised): equal greedy tokens, a divergence allowed
    only where the float model's top two are within the blocks' own error (int8 activations per 32:
    0.02 nats on the first prompt), and the adapter's tokens differ from the base model's."""
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    path = gguf_checkpoint(tmp_path / "g")
    adapter = make_adapter(ensure_tiny_model(), tmp_path / "adapter", 4, 8, False, TARGETS, seed=1)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def serve(model: Path, **kw: object) -> tuple[LLM, list[RequestOutput]]:
        llm = LLM(str(model), num_kv_blocks=64, lora_modules={"a": str(adapter)}, **kw)  # type: ignore[arg-type]
        return llm, llm.generate(PROMPTS, sampling, lora="a")

    blocks, over_blocks = serve(path, quantization="gguf")
    assert blocks.engine.runner.quantization.method == "gguf"
    floats, over_floats = serve(resolve_model(str(path)))
    assert floats.engine.runner.quantization.method == "float"
    for i, (got, want) in enumerate(zip(over_blocks, over_floats, strict=True)):
        have, ref = got.outputs[0].token_ids, want.outputs[0].token_ids
        if have != ref:
            step = next(s for s, (a, b) in enumerate(zip(have, ref, strict=False)) if a != b)
            top = want.outputs[0].logprobs[step].top  # type: ignore[index]
            assert top[0][1] - top[1][1] < QUANT_TIE, f"prompt {i} diverges at step {step}, not a near-tie"
    base = [list(o.outputs[0].token_ids) for o in blocks.generate(PROMPTS, sampling)]
    assert [list(o.outputs[0].token_ids) for o in over_blocks] != base, "the adapter changes the tokens"
