"""The engine's structured-output state: requests waiting for their grammar, one matcher per sequence.

Where it sits: built by ``Engine`` when it has a model. A constrained request is submitted
(:meth:`StructuredOutputs.submit`) and waits unscheduled, as vLLM's WAITING_FOR_FSM, until
:meth:`settled` reports its grammar compiled (its sequences get matchers and join the
scheduler) or refused (a compile error, or no grammar within ``compile_timeout_s``: the
request's 400). Each step the runner calls :meth:`mask` on the logits of the rows that sample,
and the engine calls :meth:`accept` with each constrained row's token.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import xgrammar as xgr

from kvfleet.engine.sampling_params import RequestError, StructuredOutputSpec
from kvfleet.engine.structured.bitmask import apply_bitmask
from kvfleet.engine.structured.compiler import GrammarCompilerService
from kvfleet.engine.structured.tokenizer_info import encoded_vocab, tokenizer_info
from kvfleet.engine.tokenizer.base import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 30.0


@dataclass
class _Waiting:
    spec: StructuredOutputSpec
    future: concurrent.futures.Future[xgr.CompiledGrammar]
    deadline: float


class Settled(NamedTuple):
    """A waiting request's outcome: its compiled grammar, or the refusal its client gets."""

    request_id: str
    grammar: xgr.CompiledGrammar | None
    error: RequestError | None


@dataclass
class GrammarTimes:
    """Seconds spent on the step's path (bitmask fill and apply, matcher advance), for the bench."""

    mask_s: float = 0.0
    accept_s: float = 0.0


class StructuredOutputs:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_rows: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.vocab_size = vocab_size
        info = tokenizer_info(encoded_vocab(tokenizer, vocab_size), stop_token_ids)
        self.compiler = GrammarCompilerService(info)
        self.compile_timeout_s = compile_timeout_s
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self.times = GrammarTimes()

    # ---- waiting for the grammar
    def submit(self, request_id: str, spec: StructuredOutputSpec) -> None:
        deadline = self._clock() + self.compile_timeout_s
        self._waiting[request_id] = _Waiting(spec, self.compiler.submit(spec), deadline)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def cancel(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def settled(self) -> list[Settled]:
        """The waiting requests whose grammar compiled, failed or ran out of time; they wait no more."""
        now, done = self._clock(), []
        for request_id, w in self._waiting.items():
            if w.future.done():
                exc = w.future.exception()
                if exc is None:
                    done.append(Settled(request_id, w.future.result(), None))
                else:
                    reason = f"the grammar engine cannot compile it: {_first_line(exc)}"
                    done.append(Settled(request_id, None, RequestError(w.spec.param, reason)))
            elif now >= w.deadline:
                reason = (
                    f"not compiled within {self.compile_timeout_s:g} s "
                    "(--structured-outputs-compile-timeout); simplify the schema or grammar"
                )
                done.append(Settled(request_id, None, RequestError(w.spec.param, reason)))
        for s in done:
            del self._waiting[s.request_id]
        return done

    def wait(self, timeout_s: float) -> None:
        """Block until a waiting compile finishes, at most ``timeout_s`` (nothing else to step)."""
        futures = [w.future for w in self._waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    # ---- sequences that run
    def start(self, seq_id: int, grammar: xgr.CompiledGrammar) -> None:
        self._matchers[seq_id] = xgr.GrammarMatcher(grammar)

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def is_constrained(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[int]) -> None:
        """Set to -inf, in place, every token a constrained row's grammar does not allow next.

        Row i of ``logits`` samples for ``seq_ids[i]``; rows without a matcher are not touched.
        """
        matchers = self._matchers
        rows = [i for i, seq_id in enumerate(seq_ids) if seq_id in matchers]
        if not rows:
            return
        started = time.perf_counter()
        if len(seq_ids) > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(len(seq_ids), self.vocab_size)
        bitmask = self._bitmask[: len(seq_ids)]
        for i in rows:
            matchers[seq_ids[i]].fill_next_token_bitmask(bitmask, i)
        apply_bitmask(logits, bitmask, rows, self.vocab_size)
        self.times.mask_s += time.perf_counter() - started

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher by its sampled token; True when its grammar has ended."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        started = time.perf_counter()
        if not matcher.accept_token(token_id):
            # The mask allows only what the grammar accepts: this is a bug, not the client's. End the
            # sequence rather than let it run on unconstrained.
            log.error("sequence %d: its grammar refused the sampled token %d", seq_id, token_id)
            self.times.accept_s += time.perf_counter() - started
            return True
        ended = matcher.is_terminated()
        self.times.accept_s += time.perf_counter() - started
        return bool(ended)

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: "; the client needs only the message.
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
