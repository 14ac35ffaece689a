"""LoRA adapters made in the test with peft over a tiny transformers Llama: the numerical reference.

``make_adapter`` writes a real PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``)
with random A and B (B nonzero, unlike a fresh peft adapter), and ``peft_greedy`` is PeftModel's
own greedy ``generate`` over the same base.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.engine.testing.tiny import PAD_ID

from ..model.conftest import make_checkpoint

# (rank, alpha, rsLoRA, targets): different ranks and targets, so a mixed step stacks unequal slots.
ADAPTERS: dict[str, tuple[int, int, bool, list[str]]] = {
    "attn-r4": (4, 8, False, ["q_proj", "v_proj"]),
    "mlp-r8": (8, 16, True, ["gate_proj", "up_proj", "down_proj"]),
    "all-r2": (2, 4, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(
    base: Path, folder: Path, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int
) -> Path:
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama-gqa-llama3-sharded", tmp_path_factory.mktemp("lora-base") / "base")


@pytest.fixture(scope="session")
def adapters(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(lora_base, root / name, *spec, seed=i)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }


_MODELS: dict[tuple[Path, Path | None], Any] = {}


def _reference(base: Path, adapter: Path | None) -> Any:
    key = (base, adapter)
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        model.generation_config.eos_token_id = None
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
        _MODELS[key] = model.eval()
    return _MODELS[key]


@pytest.fixture(scope="session")
def peft_greedy() -> Callable[[Path, Path | None, list[int], int], list[int]]:
    """``peft_greedy(base, adapter or None, prompt_ids, n)``: the reference tokens."""

    def greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
        model = _reference(base, adapter)
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n,
                pad_token_id=PAD_ID,
            )
        return [int(t) for t in out[0, len(prompt) :]]

    return greedy
