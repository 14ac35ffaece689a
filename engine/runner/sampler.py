"""From the logits of the rows that sample to one token per sequence (plus logprobs when asked).

Where it sits: the last stage of ``ModelRunner.execute``: the model returns float32
logits (N, vocab) for the N sequences that sample this step; :func:`sample` picks each
sequence's token by its :class:`SamplingParams`. Order as vLLM: the logit bias, the
penalties (repetition over prompt and output, then frequency and presence over the output),
temperature, then the top-k cut, then the top-p cut, then a draw. Greedy (temperature 0 or
top_k 1) is the argmax after the bias and penalties. Logprobs are of the model's own
distribution (before any of these), as vLLM's default.

A seeded request draws from a generator seeded by (seed, sample index, output position),
so its tokens do not depend on what else shares the batch nor on any state kept between
steps (a preempted and recomputed sequence draws the same tokens again). Unseeded
requests draw from the runner's one generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvfleet.engine.outputs import SampleResult, TokenLogprob
from kvfleet.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    """One row of the logits: whose it is and where in its output the token goes."""

    params: SamplingParams
    sample_index: int  # which of the request's n samples
    output_position: int  # how many tokens the sequence has generated before this one
    prompt_token_ids: Sequence[int] = ()  # read only by the penalties
    output_token_ids: Sequence[int] = field(default=())


def request_seed(seed: int, sample_index: int, output_position: int) -> int:
    """A 63-bit seed mixed from the three numbers, the same on every machine."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{output_position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k largest logits of a row (ties at the k-th value are kept); the rest become -inf."""
    if top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # Invariant: a token is kept iff the probability of the tokens ranked above it is < top_p,
    # i.e. the smallest prefix of the sorted distribution whose mass reaches top_p (never empty).
    if top_p >= 1.0:
        return logits
    probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """One row's logits after the logit bias, the repetition penalty, then frequency and presence penalties."""
    # Invariant: only the biased tokens and the tokens seen in the prompt or output change.
    out = logits.clone()
    vocab = out.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
        out.index_add_(0, ids, bias)
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
    counts = counts.to(out.device, out.dtype)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=out.device)] = True
        penalty = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(out.dtype)


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits after temperature, top-k and top-p (for a random draw)."""
    out = logits / params.temperature
    if params.top_k is not None:
        out = apply_top_k(out, params.top_k)
    return apply_top_p(out, params.top_p)


def _draw(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The drawn index, as a 0-d tensor on the logits' device (read with the step's other tokens)."""
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise)


# A token a structured output's grammar refuses has logprob -inf; OpenAI's schema wants a number, so
# it is reported as this floor (vLLM's).
LOGPROB_FLOOR = -9999.0


def _logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    logprobs = logprobs.clamp_min(LOGPROB_FLOOR)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)


class Sampler:
    """Holds the generator for unseeded requests; everything else is a pure function of the inputs.

    A step's tokens are picked on the logits' device into an int64 buffer kept between steps
    (the greedy argmax of every row at once, then the rows that penalise or draw, each written
    in place) and read back with one ``tolist``: one synchronisation per step. Logprobs, when a
    request asks, are read after it, when the device is idle. :meth:`pick` and :meth:`read` are
    the two halves, for a caller that reads a step's tokens later (async scheduling); the picks
    alternate between two buffers, so a step's tokens survive the next step's pick."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._buffers = [torch.empty(0, dtype=torch.int64, device=device) for _ in range(2)]
        self._turn = 0

    def _generator_for(self, req: SampleRequest) -> torch.Generator:
        if req.params.seed is None:
            return self._generator
        seed = request_seed(req.params.seed, req.sample_index, req.output_position)
        return torch.Generator(device=self.device).manual_seed(seed)

    def _token_buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        self._turn ^= 1
        tokens = self._buffers[self._turn]
        if tokens.shape[0] < rows or tokens.device != device:
            tokens = torch.empty(max(rows, 2 * tokens.shape[0]), dtype=torch.int64, device=device)
            self._buffers[self._turn] = tokens
        return tokens[:rows]

    def pick(self, logits: torch.Tensor, requests: list[SampleRequest] | None) -> torch.Tensor:
        """Every row's token, on the logits' device (not read); ``requests`` None: every row greedy,
        unpenalised (the argmax alone)."""
        tokens = self._token_buffer(logits.shape[0], logits.device)
        torch.argmax(logits, dim=-1, out=tokens)
        for row, req in enumerate(requests or ()):
            p = req.params
            if p.greedy and not p.penalised:
                continue
            values = logits[row]
            if p.penalised:
                values = apply_penalties(values, p, req.prompt_token_ids, req.output_token_ids)
            tokens[row] = (
                torch.argmax(values)
                if p.greedy
                else _draw(processed_logits(values, p), self._generator_for(req))
            )
        return tokens

    def read(
        self, tokens: torch.Tensor, logits: torch.Tensor, requests: list[SampleRequest] | None
    ) -> list[SampleResult]:
        """The picked tokens as results (the synchronisation), with logprobs where asked."""
        ids = tokens.tolist()
        if requests is None or not any(r.params.logprobs is not None for r in requests):
            return list(map(SampleResult, ids))
        logprobs = torch.log_softmax(logits, dim=-1)
        results = []
        for row, (req, token) in enumerate(zip(requests, ids, strict=True)):
            lp = None
            if req.params.logprobs is not None:
                lp = _logprob(logprobs[row], token, req.params.logprobs)
            results.append(SampleResult(token_id=token, logprob=lp))
        return results

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampleResult]:
        """``logits``: float32 (len(requests), vocab). Returns one result per row, in order."""
        if not requests:
            return []
        return self.read(self.pick(logits, requests), logits, requests)
