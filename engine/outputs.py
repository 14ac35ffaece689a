"""What the engine hands back: sampled tokens from the runner, per-step deltas to callers.

Where it sits: ``ModelRunner.execute(plan)`` returns one :class:`SampleResult` per
sequence that sampled this step; ``Engine.step()`` turns them into one :class:`ReqDelta`
per request that changed: only what the step added (new token ids, new text, new
logprobs, the finish reason), as vLLM's ``EngineCoreOutput`` does. A delta goes unchanged
through the core link and the request's stream to the route that writes it out. The
cumulative form is built only where one is asked for, by folding the deltas
(:meth:`RequestOutput.add` in ``LLM.generate``, :meth:`CompletionOutput.add` for the
non-streamed response).
``Engine.stats()`` is an :class:`EngineStats`, the snapshot that crosses to the API process
with every batch. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvfleet.engine.lora.stats import LoraStats


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob), best first


# A NamedTuple: the runner builds one per sampling row per step (a frozen dataclass took 3x as long).
class SampleResult(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None = None  # set when the request asked for logprobs


# NamedTuples rather than dataclasses: one is built per changed sequence per step, and they
# cross the core link as plain tuples (``messages.to_wire``).
class SeqDelta(NamedTuple):
    """What one sequence added in one step; ``choice`` is its index among the request's n."""

    choice: int
    new_text: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" in the delta that finishes it
    stop_reason: str | int | None  # the stop string or stop token id that matched
    new_logprobs: list[TokenLogprob] | None  # one per new token, when the request asked for logprobs


class ReqDelta(NamedTuple):
    """One step's news for one request: the sequences that added tokens or finished, nothing else."""

    request_id: str
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    seqs: list[SeqDelta]


@dataclass
class CompletionOutput:
    """One sequence's whole output so far, folded from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: SeqDelta) -> None:
        self.text += delta.new_text
        self.token_ids += delta.new_token_ids
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.new_logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    """A request's whole output so far: start with :meth:`empty`, then :meth:`add` each of its deltas."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def empty(cls, request_id: str, prompt_token_ids: list[int], n: int) -> RequestOutput:
        return cls(request_id, prompt_token_ids, [CompletionOutput(i) for i in range(n)])

    def add(self, delta: ReqDelta) -> None:
        for seq in delta.seqs:
            self.outputs[seq.choice].add(seq)
        self.finished, self.num_cached_tokens = delta.finished, delta.num_cached_tokens


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # blocks referenced by a sequence / all blocks
    num_kv_blocks: int
    max_num_seqs: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens of requests that produced a first token
    generation_tokens_total: int  # tokens sampled (recomputation after preemption not counted)
    num_requests_finished: int
    lora: LoraStats | None = None  # None when the engine serves no adapters
