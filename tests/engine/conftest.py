"""Deterministic stand-ins for the model side, so the engine core is tested without torch.

``ByteTokenizer``: one token per byte (0..255) and the real one's special ids (``<s>`` 256, ``</s>``
257 = EOS, ``<pad>`` 258; vocab 259), but it adds no BOS and its chat template only joins the contents.
``FakeRunner``: the next token is ``next_token(last token)``; it records every plan it ran
and checks that each sequence's block table covers the KV it is asked to compute. Its steps take
no time, but it keeps a clock of its own (``last_step_seconds``: 10 ms + 1 ms a batched token) for
the stall-free scheduler's cost model, so the plans it is given do not depend on the machine.
:func:`fold`: the engine's deltas folded into whole outputs, as ``LLM.generate`` folds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvfleet.engine.outputs import CompletionOutput, ReqDelta, RequestOutput, SampleResult, TokenLogprob
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.tokenizer.byte_level import BOS_TOKEN_ID, EOS_TOKEN_ID

EOS = EOS_TOKEN_ID
BOS = BOS_TOKEN_ID


class ByteTokenizer:
    eos_token_ids = frozenset({EOS})
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return "".join(str(m["content"]) for m in messages)


def fold(deltas: Iterable[ReqDelta]) -> dict[str, RequestOutput]:
    """Each request's whole output from its deltas (prompt ids unknown here: left empty)."""
    outs: dict[str, RequestOutput] = {}
    for d in deltas:
        out = outs.setdefault(d.request_id, RequestOutput(d.request_id, [], []))
        for s in d.seqs:
            while len(out.outputs) <= s.choice:
                out.outputs.append(CompletionOutput(len(out.outputs)))
        out.add(d)
    return outs


def next_byte(last: int) -> int:
    """'a' → 'b' → ... → 'z' → 'a'; anything else → 'a'."""
    return ord("a") + (last - ord("a") + 1) % 26 if ord("a") <= last <= ord("z") else ord("a")


@dataclass
class RanEntry:
    request_id: str
    index: int
    start: int
    num_new: int
    block_ids: tuple[int, ...]


@dataclass
class FakeRunner:
    num_kv_blocks: int = 64
    block_size: int = 4
    next_token: Callable[[int], int] = next_byte
    steps: list[list[RanEntry]] = field(default_factory=list)
    last_step_seconds: float = 0.0

    def execute(self, plan: SchedulerPlan) -> dict[int, SampleResult]:
        ran: list[RanEntry] = []
        out: dict[int, SampleResult] = {}
        for e in plan.scheduled:
            assert len(e.block_ids) * self.block_size >= e.context_len, "block table too short"
            ran.append(
                RanEntry(e.seq.request_id, e.seq.index, e.num_computed_before, e.num_new_tokens, e.block_ids)
            )
            if e.sample:
                tok = self.next_token(e.token_ids[-1])
                lp = TokenLogprob(tok, -0.25, ((tok, -0.25),)) if e.seq.params.logprobs is not None else None
                out[e.seq.seq_id] = SampleResult(tok, lp)
        self.steps.append(ran)
        self.last_step_seconds = 0.01 + 0.001 * plan.num_batched_tokens
        return out


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def make_engine(tokenizer: ByteTokenizer) -> Callable[..., Any]:
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.core.engine import Engine

    def build(num_kv_blocks: int = 64, next_token: Callable[[int], int] = next_byte, **config: Any) -> Engine:
        config.setdefault("block_size", 4)
        config.setdefault("max_model_len", 64)
        runner = FakeRunner(num_kv_blocks, config["block_size"], next_token)
        return Engine(EngineConfig(**config), runner, tokenizer)

    return build
