"""The offline API in the style of vLLM's ``LLM``: build an engine, run prompts to completion.

Where it sits: on top of :class:`kvfleet.engine.core.engine.Engine`; it adds every prompt as a
request, steps the engine until all finish, and returns the final outputs in prompt order:
the one place besides the non-streamed server response where the engine's deltas are
folded into a cumulative :class:`RequestOutput`. Every request runs as
``RequestOutputKind.FINAL_ONLY`` (as vLLM's ``LLM`` does), so the engine hands each request
one delta, when it finishes, holding the whole completion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.core.messages import EmbedCmd
from kvfleet.engine.core.pooling import embed
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampling_params import RequestError, RequestOutputKind, SamplingParams

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


class LLM:
    """``LLM(model="tiny" | path, **EngineConfig fields)``; ``engine`` is the underlying :class:`Engine`."""

    def __init__(self, model: str = "tiny", *, engine: Engine | None = None, **config: Any) -> None:
        self.engine = engine if engine is not None else Engine(EngineConfig(model=model, **config))
        self._counter = 0

    def generate(
        self,
        prompts: Prompts,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one :class:`RequestOutput` per prompt, in order.

        ``lora``: the adapter (a name from ``lora_modules`` or :meth:`load_lora`) for every prompt,
        or one per prompt (None: the base model).
        """
        batch = _as_batch(prompts)
        per_prompt = _per_prompt_params(params, len(batch))
        adapters = _per_prompt_lora(lora, len(batch))
        outputs: dict[str, RequestOutput] = {}
        try:
            for prompt, p, adapter in zip(batch, per_prompt, adapters, strict=True):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                prompt_ids = self.engine.add_request(request_id, prompt, p, lora=adapter)
                outputs[request_id] = RequestOutput.empty(request_id, prompt_ids, p.n)
            self._run(outputs)
        except BaseException:
            for request_id in outputs:
                self.engine.abort(request_id)
            raise
        return list(outputs.values())

    def embed(self, prompts: Prompts, dimensions: int | None = None) -> list[list[float]]:
        """Each prompt's embedding, in order (``runner="pooling"``, as vLLM's ``LLM.embed``); a RequestError
        naming the field if the engine refuses them (a generating engine names ``model``)."""
        tokenizer = self.engine.tokenizer
        ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in _as_batch(prompts)]
        self._counter += 1
        done = embed(self.engine, EmbedCmd(f"llm-{self._counter - 1}", ids, dimensions))
        if done.reason is not None:
            raise RequestError(done.field, done.reason)
        return [np.frombuffer(v, dtype="<f4").tolist() for v in done.vectors]

    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter folder under ``name`` (needs ``enable_lora=True`` or ``lora_modules``)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also end with this process)."""
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            close()

    def _run(self, outputs: dict[str, RequestOutput]) -> None:
        """Step until every output is finished, folding each delta into its request's output."""
        pending = set(outputs)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)} left the engine without a final output")
            deltas = self.engine.step()
            for request_id, error in self.engine.take_verdicts():
                if error is not None and request_id in pending:
                    raise error  # its structured-output grammar did not compile
            for delta in deltas:
                out = outputs.get(delta.request_id)
                if out is not None:
                    out.add(delta)
                    if delta.finished:
                        pending.discard(delta.request_id)


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


def _per_prompt_lora(lora: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"lora: got {len(lora)} adapter names for {n} prompts; pass one, or one per prompt")
    return list(lora)


def _final_only(params: SamplingParams) -> SamplingParams:
    """The same params as FINAL_ONLY; anything that is not a SamplingParams is left for the engine to reject."""
    if not isinstance(params, SamplingParams) or params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
