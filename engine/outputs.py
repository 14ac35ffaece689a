"""What the engine hands back: sampled tokens from the runner, request outputs to callers.

Where it sits: ``ModelRunner.execute(plan)`` returns one :class:`SampleResult` per
sequence that sampled this step; ``Engine.step()`` turns them into
:class:`RequestOutput` updates for the server and for ``LLM.generate``. ``Engine.stats()``
is an :class:`EngineStats`, the snapshot that crosses to the API process with every batch
(torch-free, like the rest of this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob), best first


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None = None  # set when the request asked for logprobs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] | None = None
    # What this update adds since the previous one (for streaming).
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


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
