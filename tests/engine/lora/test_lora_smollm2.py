"""SmolLM2-135M-Instruct with an adapter made in the test: the engine's greedy tokens equal PeftModel's
over transformers' float32 load of the same GGUF, adapter and base requests in one batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader.sources import resolve_model, smollm2_gguf
from kvfleet.engine.tokenizer.hf import HFTokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
CHATS = ["Name a colour.", "Count to five."]


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no spin-waiting threads on a shared 2-core box (as test_smollm2.py)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def peft_smollm2(single_thread: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """PeftModel over the GGUF in float32 with a random rank-8 adapter on q, v and down; its saved folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    folder = tmp_path_factory.mktemp("smollm2-lora") / "adapter"
    peft_model.save_pretrained(folder)
    return peft_model, folder


def test_an_adapter_on_smollm2_gives_peft_greedy_tokens_beside_base_requests(
    peft_smollm2: tuple[Any, Path],
) -> None:
    peft_model, folder = peft_smollm2
    tokenizer = HFTokenizer(resolve_model("smollm2"))
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False
        )
        for c in CHATS
    ]

    def reference(prompt: list[int], adapter: bool) -> list[int]:
        # An explicit mask: the prompt holds <|im_end|> (id 2), which generate would take for padding.
        ids = {
            "input_ids": torch.tensor([prompt]),
            "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
        }
        greedy = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "pad_token_id": 2}
        with torch.no_grad():
            if adapter:
                out = peft_model.generate(**ids, **greedy)
            else:
                with peft_model.disable_adapter():
                    out = peft_model.generate(**ids, **greedy)
        return [int(t) for t in out[0, len(prompt) :]]

    llm = LLM(
        model="smollm2", attention_backend="torch", num_kv_blocks=64, lora_modules={"tuned": str(folder)}
    )
    requests = [(p, lora) for p in prompts for lora in (None, "tuned")]
    outs = llm.generate([p for p, _ in requests], GREEDY, lora=[lora for _, lora in requests])
    want = [reference(p, lora is not None) for p, lora in requests]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[0] != want[1], "the adapter changes the answer"
