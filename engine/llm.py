"""The offline API in the style of vLLM's ``LLM``: build an engine, run prompts to completion.

Where it sits: on top of :class:`kvfleet.engine.engine.Engine`; it adds every prompt as a
request, steps the engine until all finish, and returns the final outputs in prompt order.
Every request runs as ``RequestOutputKind.FINAL_ONLY`` (as vLLM's ``LLM`` does): nothing here
reads the per-step deltas, so the engine builds each request's output once, when it finishes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.engine import Engine
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampling_params import RequestOutputKind, SamplingParams

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


class LLM:
    """``LLM(model="tiny" | path, **EngineConfig fields)``; ``engine`` is the underlying :class:`Engine`."""

    def __init__(self, model: str = "tiny", *, engine: Engine | None = None, **config: Any) -> None:
        self.engine = engine if engine is not None else Engine(EngineConfig(model=model, **config))
        self._counter = 0

    def generate(
        self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one :class:`RequestOutput` per prompt, in order."""
        batch = _as_batch(prompts)
        per_prompt = _per_prompt_params(params, len(batch))
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, per_prompt, strict=True):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
            finals = self._run(set(ids))
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return [finals[i] for i in ids]

    def _run(self, pending: set[str]) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(pending):
            if not self.engine.has_unfinished_requests():
                missing = sorted(pending - set(finals))
                raise RuntimeError(f"requests {missing} left the engine without a final output")
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    finals[out.request_id] = out
        return finals


def _as_batch(prompts: Prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    batch: list[str | list[int]] = []
    for p in prompts:
        batch.append(p if isinstance(p, str) else list(p))
    return batch


def _per_prompt_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [_final_only(SamplingParams())] * n
    if isinstance(params, SamplingParams):
        return [_final_only(params)] * n
    if len(params) != n:
        raise ValueError(
            f"params: got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt"
        )
    return [_final_only(p) for p in params]


def _final_only(params: SamplingParams) -> SamplingParams:
    """The same params as FINAL_ONLY; anything that is not a SamplingParams is left for the engine to reject."""
    if not isinstance(params, SamplingParams) or params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
