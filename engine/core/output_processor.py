"""Turns each sequence's sampled tokens into text and decides when the sequence stops.

Where it sits: ``Engine.step()`` → ``Scheduler.update()`` appends the sampled token →
:meth:`SeqOutputState.on_token` detokenises it and checks the stop conditions →
:meth:`SeqOutputState.delta` hands out what the sequence added since its previous delta.

Stop conditions, in the order checked (all but the length limits wait for
``min_tokens`` output tokens): EOS (unless ``ignore_eos``), a stop token id, a stop
string in the detokenised text, then ``max_tokens`` and the context limit ("length").
The EOS / stop token stays in ``token_ids`` but adds no text. A matched stop string is
cut from the text (kept with ``include_stop_str_in_output``).

Text is decoded as the tokens come only where something reads it before the end: a stream
(per-step deltas) or a stop string. Otherwise (``lazy_text``: ``LLM.generate``'s final-only
outputs without stop strings) the tokens are decoded in one push when the sequence finishes;
an incremental UTF-8 decoder gives the same text however the bytes are split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.engine.outputs import ReqDelta, SampleResult, SeqDelta, TokenLogprob
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence, SequenceStatus
from kvfleet.engine.tokenizer.base import Tokenizer
from kvfleet.engine.tokenizer.detokenizer import IncrementalDetokenizer

DetokenizerFactory = Callable[[Tokenizer], IncrementalDetokenizer]


def find_stop_string(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The earliest stop string occurring in ``text`` at or after ``start``: (index, stop string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, start)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could still be the start of a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


@dataclass(slots=True)
class SeqOutputState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""  # everything decoded so far (cut at the stop string once matched)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[TokenLogprob] | None = None  # those not yet handed out, when asked for
    _sent_chars: int = 0
    _sent_tokens: int = 0
    _finish_sent: bool = False
    _max_stop_len: int = field(default=0, init=False)
    lazy_text: bool = False  # decode only when finished (nobody reads the text before)
    _decoded: int = 0  # output tokens pushed to the detokenizer so far, when lazy

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.seq.params.stop), default=0)
        if self.seq.params.logprobs is not None:
            self.new_logprobs = []

    # Invariant: returns a finished status exactly once, on the token that ends the sequence.
    def on_token(
        self, result: SampleResult, eos_token_ids: frozenset[int], max_len: int
    ) -> SequenceStatus | None:
        """Take the token just appended to the sequence; the status it finishes with, if any."""
        seq = self.seq
        params = seq.params
        token_id = result.token_id
        if self.new_logprobs is not None:
            self.new_logprobs.append(result.logprob or TokenLogprob(token_id, float("nan")))
        num_output = len(seq.output_token_ids)
        may_stop = num_output >= params.min_tokens
        is_eos = not params.ignore_eos and token_id in eos_token_ids
        if may_stop and (is_eos or token_id in params.stop_token_ids):
            self.stop_reason = token_id if token_id in params.stop_token_ids else None
            self._catch_up(num_output - 1)  # the stop token adds no text
            return self._finish(SequenceStatus.FINISHED_STOPPED)
        if self.lazy_text:
            if num_output >= params.max_tokens or len(seq.prompt_token_ids) + num_output >= max_len:
                self._catch_up(num_output)
                self.text += self.detokenizer.flush()
                return self._finish(SequenceStatus.FINISHED_LENGTH)
            return None
        new_text = self.detokenizer.push([token_id])
        self.text += new_text
        if may_stop and params.stop and self._stop_string_found(new_text, params):
            return self._finish(SequenceStatus.FINISHED_STOPPED)
        if num_output >= params.max_tokens or len(seq.prompt_token_ids) + num_output >= max_len:
            self.text += self.detokenizer.flush()
            return self._finish(SequenceStatus.FINISHED_LENGTH)
        return None

    def _catch_up(self, upto: int) -> None:
        """Lazy text: push the output tokens not yet decoded, up to ``upto``."""
        if self.lazy_text and upto > self._decoded:
            self.text += self.detokenizer.push(self.seq.output_token_ids[self._decoded : upto])
            self._decoded = upto

    def _stop_string_found(self, new_text: str, params: SamplingParams) -> bool:
        """Cut the text at a stop string that the new text completed; True if there was one."""
        start = max(0, len(self.text) - len(new_text) - self._max_stop_len + 1)
        found = find_stop_string(self.text, params.stop, start)
        if found is None:
            return False
        idx, stop = found
        self.text = self.text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
        self.stop_reason = stop
        return True

    def _finish(self, status: SequenceStatus) -> SequenceStatus:
        self.finish_reason = status.value
        return status

    def stop(self) -> SequenceStatus:
        """Finish with "stop" for a reason outside this state (a structured output's grammar ended)."""
        self._catch_up(len(self.seq.output_token_ids))
        self.text += self.detokenizer.flush()
        return self._finish(SequenceStatus.FINISHED_STOPPED)

    def abort(self) -> None:
        if self.finish_reason is None:
            self._catch_up(len(self.seq.output_token_ids))
            self.finish_reason = SequenceStatus.FINISHED_ABORTED.value

    @property
    def has_news(self) -> bool:
        """True while a token or the finish has not been handed out in a delta."""
        return self._sent_tokens < len(self.seq.output_token_ids) or (
            self.finish_reason is not None and not self._finish_sent
        )

    def delta(self) -> SeqDelta:
        """What the sequence added since the previous delta; text that may begin a stop string waits."""
        text, sent_chars = self.text, self._sent_chars
        emit_to = len(text)
        stops = self.seq.params.stop
        if stops and self.finish_reason is None:
            emit_to = max(emit_to - held_back(text, stops), sent_chars)
        token_ids = self.seq.output_token_ids
        new_logprobs = self.new_logprobs
        if new_logprobs is not None:
            self.new_logprobs = []
        out = SeqDelta(
            self.seq.index,
            text[sent_chars:emit_to],
            token_ids[self._sent_tokens :],
            self.finish_reason,
            self.stop_reason,
            new_logprobs,
        )
        self._sent_chars, self._sent_tokens = emit_to, len(token_ids)
        self._finish_sent = self.finish_reason is not None
        return out


@dataclass
class RequestState:
    """A request's output states, one per sample (n), and how its deltas go out."""

    request_id: str
    prompt_token_ids: list[int]
    states: list[SeqOutputState]
    per_step: bool  # an output every step it samples; else only when it finishes (FINAL_ONLY)
    reads_host_tokens: bool = False  # its sampling needs the previous token on the host (async scheduling)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.states)

    def delta(self) -> ReqDelta:
        """What the request's sequences added since its previous delta (only those with news)."""
        return ReqDelta(
            self.request_id,
            self.finished,
            len(self.prompt_token_ids),
            self.states[0].seq.num_cached_tokens,
            [s.delta() for s in self.states if s.has_news],
        )
