"""Tiny random mixture-of-experts checkpoints made with transformers' own config classes
(Qwen3MoeConfig, Mixtral): 8 experts, top-2, a few layers, saved by ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.outputs import RequestOutput

from ..parallel.workers import assert_workers_ran
from .conftest import COMMON, QK_NORMS, save_checkpoint

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
SYSTEM = [256] + list(range(60, 80))  # a 21-token prefix shared by half the prompts
PROMPTS = [
    SYSTEM + [72 + i, 101, 108 + i] if i % 2 == 0 else [256] + list(range(3 * i, 3 * i + 2 + i))
    for i in range(16)
]
# 16-token steps (chunked prefill), 4-token blocks, too few for all 16 sequences (preemption).
ENGINE: dict[str, Any] = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=16)
LOGPROB_TOL = 1e-4


SHAPE: dict[str, Any] = {**COMMON, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
# The two Qwen3-MoE variants' experts: 8 of width 40 (narrower than the dense MLP), 2 per token.
QWEN3_EXPERTS: dict[str, Any] = dict(
    head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40
)
MOE_VARIANTS: dict[str, Any] = {
    # Qwen3-MoE: per-head q/k norms, experts narrower than the dense MLP, layer 1 dense, no renormalisation.
    "qwen3-moe": lambda: Qwen3MoeConfig(**SHAPE, **QWEN3_EXPERTS, norm_topk_prob=False, mlp_only_layers=[1]),
    # Qwen3-MoE renormalising its top-k weights (norm_topk_prob), every layer sparse.
    "qwen3-moe-norm": lambda: Qwen3MoeConfig(**SHAPE, **QWEN3_EXPERTS, norm_topk_prob=True),
    # Mixtral: always renormalised, experts of intermediate_size (an odd 161: uneven at tp=2).
    "mixtral": lambda: MixtralConfig(
        **{**SHAPE, "intermediate_size": 161}, num_local_experts=8, num_experts_per_tok=2
    ),
}


def make_moe_checkpoint(variant: str, folder: Path, config: Any = None) -> Path:
    """``variant``'s checkpoint (or ``config``'s, named ``variant``) saved in ``folder``."""
    config = MOE_VARIANTS[variant]() if config is None else config
    return save_checkpoint(config, folder, variant, (("gate.weight", 0.0, 0.5), QK_NORMS))  # decisive routing


def hf_eager(folder: Path) -> Any:
    """transformers' model with its eager experts (one expert at a time, its reference loop): the
    default ``grouped_mm`` wants 16-byte strides, which Mixtral's odd intermediate size is not."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_tokens_and_logprobs(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
    )  # fmt: skip
    tokens = [int(t) for t in out[0, len(prompt) :]]
    with torch.no_grad():
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, logprobs.tolist()


def engine_outputs(folder: Path, tp: int = 1) -> tuple[list[RequestOutput], Any]:
    """The engine's outputs for ``PROMPTS`` (the first alone, warming the prefix cache) and its stats."""
    llm = LLM(str(folder), tensor_parallel_size=tp, **ENGINE)
    try:
        first = llm.generate(PROMPTS[:1], GREEDY)
        rest = llm.generate(PROMPTS[1:], GREEDY)
        assert_workers_ran(llm, tp)
        return first + rest, llm.engine.stats()
    finally:
        llm.close()


def assert_equal_to_transformers(label: str, folder: Path, outs: list[RequestOutput]) -> None:
    """Every prompt's greedy tokens equal transformers', their logprobs within ``LOGPROB_TOL``."""
    model = hf_eager(folder)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        want, want_lp = hf_tokens_and_logprobs(model, prompt)
        assert out.outputs[0].token_ids == want, f"{label}: prompt {i}"
        got_lp = [lp.logprob for lp in out.outputs[0].logprobs or []]
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=LOGPROB_TOL)
