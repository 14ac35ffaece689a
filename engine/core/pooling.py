"""The engine core's embeddings: an EmbedCmd's prompts pooled by the runner, in batches the token budget holds.

Where it sits: ``CoreLoop.apply`` (``engine/core/loop.py``) answers each
:class:`~kvfleet.engine.core.messages.EmbedCmd` between steps with :func:`embed`, and the
:class:`~kvfleet.engine.core.messages.Embedded` rides back in the next ``StepBatch``. The prompts go
to the runner's ``pool`` (``engine/model/pooling.py`` behind ``ModelRunner.pool``) many at a time,
each batch at most ``max_num_batched_tokens`` tokens (a prompt longer than that goes alone), as a
prefill step would be sized; no KV block is taken and nothing is sampled. A pooling engine
(``--runner pooling``) serves nothing else, so no decode waits behind these batches. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.engine.core.messages import EmbedCmd, Embedded
from kvfleet.engine.sampling_params import RequestError

if TYPE_CHECKING:  # the engine imports torch's side (its runner): named for the type checker only
    from kvfleet.engine.core.engine import Engine


def token_batches(prompts: list[list[int]], budget: int) -> list[list[list[int]]]:
    """The prompts in order, cut into runs of at most ``budget`` tokens (a longer prompt: a run of its own)."""
    # Invariant: concatenating the runs gives the prompts back in order; a run of several fits the budget.
    runs: list[list[list[int]]] = []
    tokens = 0
    for p in prompts:
        if not runs or tokens + len(p) > budget:
            runs.append([])
            tokens = 0
        runs[-1].append(p)
        tokens += len(p)
    return runs


def embed(engine: Engine, cmd: EmbedCmd) -> Embedded:
    """The embeddings of ``cmd.prompts`` in order, or the RequestError refusing them (no vector then)."""
    num_tokens = sum(len(p) for p in cmd.prompts)
    try:
        for i, p in enumerate(cmd.prompts):
            if not p:
                raise RequestError("input", f"input[{i}] is empty (0 tokens)")
            bad = next((t for t in p if not 0 <= t < engine.tokenizer.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    "input", f"token id {bad} is outside the vocabulary (size {engine.tokenizer.vocab_size})"
                )
            if len(p) > engine.max_model_len:
                raise RequestError(
                    "input",
                    f"input[{i}] is {len(p)} tokens, but this model's maximum context length is "
                    f"{engine.max_model_len} tokens",
                )
        vectors: list[bytes] = []
        for run in token_batches(cmd.prompts, engine.config.max_num_batched_tokens):
            vectors.extend(engine.runner.pool(run, cmd.dimensions))
    except RequestError as exc:
        return Embedded(cmd.request_id, [], num_tokens, exc.reason, exc.field)
    return Embedded(cmd.request_id, vectors, num_tokens)
