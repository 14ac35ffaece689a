"""Per-request sampling settings, validated once at the edge of the engine.

Where it sits: the server (or ``LLM.generate``) builds a :class:`SamplingParams` per
request; the scheduler reads ``max_tokens`` and the stop conditions, the sampler reads
the rest. Invalid values raise :class:`SamplingParamsError` naming the field, the value
and the limit, before anything is allocated. :class:`RequestError` is the one exception for
a request the engine refuses (the server's 400), whichever side of the core link refuses it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal


class RequestError(ValueError):
    """A request the engine refuses, before anything was allocated; ``field`` names the offending field.

    ``reason`` is the message without the field; the core process sends (reason, field) in its
    verdict and the API process raises the same error again from them.
    """

    def __init__(self, field_name: str | None, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}" if field_name else reason)
        self.field = field_name
        self.reason = reason


class SamplingParamsError(RequestError):
    """A sampling parameter outside its range; ``field`` names it."""


class RequestOutputKind(enum.Enum):
    """Which steps produce a :class:`RequestOutput` for a request (as vLLM's ``RequestOutputKind``)."""

    PER_STEP = "per_step"  # every step that samples a token: what it added (streaming)
    FINAL_ONLY = "final_only"  # only the step that finishes it: the whole completion (``LLM.generate``)


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a constrained row's output must match; the core compiles it once per distinct spec.

    ``value``: json: the JSON schema as JSON text; json_object: ""; regex: the pattern; choice: a
    JSON list of strings; grammar: EBNF (xgrammar's dialect). ``source`` names the request field
    it came from (a compile error's 400 names it); it is not part of the spec's identity.
    """

    kind: StructuredKind
    value: str
    source: str = field(default="", compare=False)

    @property
    def param(self) -> str:
        """The request field a refusal names: ``source``, or one derived from the kind."""
        return self.source or (
            "response_format" if self.kind in ("json", "json_object") else f"guided_{self.kind}"
        )


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's and the top-k logprobs
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = (
        1.0  # vLLM: a token in the prompt or output has its logit divided (> 0) or multiplied (< 0)
    )
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.PER_STEP
    # vLLM's request-level ``cache_salt``: prefix-cache blocks are shared only between requests
    # of equal salts (the router sets it to the tenant); None shares with every unsalted request.
    cache_salt: str | None = None
    # Structured outputs (engine/structured): the output is constrained to a schema, regex, choice or
    # grammar; None: free.
    structured: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        # Accept lists (or one string) from callers; store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise SamplingParamsError("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0.0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise SamplingParamsError("top_k", f"must be at least 1 (or None for no cut), got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(k.name for k in RequestOutputKind)
            raise SamplingParamsError(
                "output_kind", f"must be a RequestOutputKind ({kinds}), got {self.output_kind!r}"
            )
        self._validate_penalties()
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise SamplingParamsError(
                "cache_salt", f"must be a non-empty string if given, got {self.cache_salt!r}"
            )
        if self.structured is not None and (
            not isinstance(self.structured, StructuredOutputSpec)
            or self.structured.kind not in STRUCTURED_KINDS
        ):
            raise SamplingParamsError(
                "structured",
                f"must be a StructuredOutputSpec of a kind in {STRUCTURED_KINDS}, got {self.structured!r}",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"token ids must be >= 0, got {self.stop_token_ids}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise SamplingParamsError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise SamplingParamsError("logit_bias", f"token ids must be >= 0, got {token}")
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(
                    "logit_bias", f"biases must be in [-100, 100], got {bias} for token {token}"
                )

    @property
    def penalised(self) -> bool:
        """Whether the sampler must change the logits before temperature (penalties or a bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @cached_property  # read per sampling row per step; the params never change (frozen)
    def plain_greedy(self) -> bool:
        """Whether the row's token is the logits' argmax and nothing else is asked (no logprobs)."""
        return self.greedy and not self.penalised and self.logprobs is None
