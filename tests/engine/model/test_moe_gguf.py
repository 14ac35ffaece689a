"""GGUF ``qwen3moe`` (llama.cpp's Qwen3-MoE): metadata ``expert_count`` / ``expert_used_count`` /
``expert_feed_forward_length`` and the experts stacked (E, out, in) in ``ffn_{gate,up,down}_exps``
with the router ``ffn_gate_inp``. An F32 file converts back to the transformers checkpoint it was
written from, bit for bit, and serves transformers' tokens; a Q8_0 file is served with each expert
in its own rows of blocks (grouped, ``engine/layers/moe``) and picks its dequantised weights' greedy
token wherever the routing and the top token are clear."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Qwen3MoeConfig

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.layers.moe import KernelExperts, Routing
from kvfleet.engine.layers.moe import router as router_module
from kvfleet.engine.layers.moe.router import softmax_topk
from kvfleet.engine.loader.gguf_convert import gguf_folder, read_gguf
from kvfleet.engine.loader.gguf_loader import load_quantized_model
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.model.moe import SparseMoeBlock
from kvfleet.engine.testing.tiny_gguf import write_gguf

from .moe_checkpoints import PROMPTS, SHAPE, hf_eager, hf_tokens_and_logprobs, make_moe_checkpoint
from .test_runner_hf_equivalence import prefill_logits

Q = gguf.GGMLQuantizationType
TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
MARGIN = 0.5  # a prompt's top token leads the next by this much (logits) in the dequantised model
ROUTE_GAP = 0.015  # and every routing choice by this much probability (measured tips: 0.006, 0.01 apart)


@pytest.fixture(scope="module")
def qwen3moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE as llama.cpp's qwen3moe runs it (top-k renormalised, every layer sparse), experts
    96 wide: every linear's rows split into whole 32-value quantisation blocks."""
    config = Qwen3MoeConfig(
        **SHAPE,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        norm_topk_prob=True,
    )
    return make_moe_checkpoint("qwen3moe-gguf", tmp_path_factory.mktemp("qwen3moe"), config)


def _gguf(folder: Path, path: Path, qtype: Q) -> Path:
    config = json.loads((folder / "config.json").read_text())
    return write_gguf(
        path, load_file(str(folder / "model.safetensors")), arch="qwen3moe", qtype=qtype, config=config
    )


def test_the_tiny_writer_stacks_the_experts_as_llama_cpp_and_keeps_the_router_float(
    qwen3moe_folder: Path, tmp_path: Path
) -> None:
    model = read_gguf(_gguf(qwen3moe_folder, tmp_path / "m.gguf", Q.Q8_0))
    shapes = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type) for t in model.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == ((64, 96, 8), Q.Q8_0)  # GGUF lists dims innermost first
    assert shapes["blk.2.ffn_down_exps.weight"] == ((96, 64, 8), Q.Q8_0)
    assert shapes["blk.1.ffn_gate_inp.weight"] == ((64, 8), Q.F32)
    config = model.config
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (
        8,
        2,
        96,
    )
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True


def test_a_qwen3moe_gguf_without_its_expert_count_is_refused_naming_the_field(
    qwen3moe_folder: Path, tmp_path: Path
) -> None:
    config = json.loads((qwen3moe_folder / "config.json").read_text())
    weights = load_file(str(qwen3moe_folder / "model.safetensors"))
    path = write_gguf(
        tmp_path / "m.gguf", weights, arch="qwen3moe", config=config, skip=("qwen3moe.expert_count",)
    )
    with pytest.raises(ModelLoadError, match=r"m\.gguf: field qwen3moe\.expert_count is missing"):
        read_gguf(path)


def test_an_f32_qwen3moe_gguf_converts_back_bit_for_bit_and_serves_transformers_tokens(
    qwen3moe_folder: Path, tmp_path: Path, cache: Path
) -> None:
    original = load_file(str(qwen3moe_folder / "model.safetensors"))
    path = _gguf(qwen3moe_folder, tmp_path / "m.gguf", Q.F32)
    converted = load_file(str(gguf_folder(path) / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in converted
    for name, array in original.items():
        np.testing.assert_array_equal(converted[name], array, err_msg=name)
    hf = hf_eager(qwen3moe_folder)
    llm = LLM(model=str(path), num_kv_blocks=48, block_size=4)
    try:
        outs = llm.generate(PROMPTS[:4], GREEDY)
    finally:
        llm.close()
    for prompt, out in zip(PROMPTS[:4], outs, strict=True):
        assert out.outputs[0].token_ids == hf_tokens_and_logprobs(hf, prompt)[0][:TOKENS]


def test_a_q8_0_qwen3moe_is_served_in_its_blocks_with_its_dequantised_weights_greedy_tokens(
    qwen3moe_folder: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel rounds activations to int8 per 32 (llama.cpp's Q8_0 activations): a routing choice
    the dequantised model makes by less than ``ROUTE_GAP`` may tip, and a tipped expert changes the
    token. So the prompts compared are those whose every routing choice (the k-th expert's
    probability over the next one's) is clear by ``ROUTE_GAP`` and whose top token leads by
    ``MARGIN``: there the greedy token is the dequantised model's, the logits within 8% of their
    largest magnitude (measured: 0.30 of 5.7; 11 of the 128 prompts clear)."""
    path = _gguf(qwen3moe_folder, tmp_path / "m-Q8_0.gguf", Q.Q8_0)
    reference = tmp_path / "reference"
    shutil.copytree(qwen3moe_folder, reference)
    original = load_file(str(qwen3moe_folder / "model.safetensors"))
    dequantised = {
        k: _dequantised(v).numpy() if v.ndim == 2 and not k.endswith("mlp.gate.weight") else v
        for k, v in original.items()
    }
    save_file(dequantised, str(reference / "model.safetensors"))
    served, loader = _prefill(path, gguf_folder(path))
    assert loader == "gguf", "served in its blocks, not dequantised"
    gaps: list[torch.Tensor] = []  # per sparse layer, the k-th minus the (k+1)-th probability of each row

    def recording(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
        top = torch.softmax(logits.float(), dim=-1).topk(top_k + 1, dim=-1).values
        gaps.append(top[:, top_k - 1] - top[:, top_k])
        return softmax_topk(logits, top_k, renormalize)

    monkeypatch.setitem(router_module._ROUTERS, "softmax_topk", recording)
    expected, _ = _prefill(reference, reference)
    top2 = expected.topk(2, dim=-1).values
    clear = [
        bool(top2[p, 0] - top2[p, 1] > MARGIN) and all(bool(g.min() > ROUTE_GAP) for g in _rows_of(p, gaps))
        for p in range(len(SHORT))
    ]
    assert sum(clear) >= 8, f"too few prompts with clear routing and a clear top token ({sum(clear)})"
    rows = torch.tensor(clear)
    assert served[rows].argmax(-1).tolist() == expected[rows].argmax(-1).tolist()
    scale = float(expected[rows].abs().max())
    torch.testing.assert_close(served[rows], expected[rows], atol=0.08 * scale, rtol=0)


SHORT = [[256, i] for i in range(0, 256, 2)]  # 2 tokens each: few routing choices


def _rows_of(prompt: int, gaps: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prompt ``prompt``'s rows of each layer's gaps: all its tokens, or (the last layer's, whose
    other rows nobody reads) its last one."""
    n = len(SHORT[prompt])
    return [
        g[prompt * n : (prompt + 1) * n] if len(g) == n * len(SHORT) else g[prompt : prompt + 1] for g in gaps
    ]


def _prefill(model: Path, folder: Path) -> tuple[torch.Tensor, str]:
    return prefill_logits(model, folder, SHORT, num_kv_blocks=160)


def test_each_q8_0_expert_gets_its_own_rows_of_blocks_and_the_router_stays_float(
    qwen3moe_folder: Path, tmp_path: Path, cache: Path
) -> None:
    """Every expert's two matmuls within 3% (of the largest output) of its own dequantised weights'
    (measured: 0.9%, the kernel's int8 activations); another expert's rows would be far off."""
    path = _gguf(qwen3moe_folder, tmp_path / "m-Q8_0.gguf", Q.Q8_0)
    original = load_file(str(qwen3moe_folder / "model.safetensors"))
    model = load_quantized_model(str(path), gguf_folder(path), torch.float32, torch.device("cpu"), path)
    x, h = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)), torch.randn(5, 96)
    for i, layer in enumerate(model.model.layers):
        ffn = layer.feed_forward()
        assert isinstance(ffn, SparseMoeBlock) and isinstance(ffn.fixed, KernelExperts)
        router = original[f"model.layers.{i}.mlp.gate.weight"]
        assert torch.equal(ffn.gate.weight, torch.from_numpy(router))
        for e in range(8):
            w = {p: _dequantised(original[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"]) for p in PROJ}
            _close(ffn.fixed.gate_up(e, x), x @ torch.cat([w["gate_proj"], w["up_proj"]]).T)
            _close(ffn.fixed.down(e, h), h @ w["down_proj"].T)


PROJ = ("gate_proj", "up_proj", "down_proj")


def _dequantised(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0)
