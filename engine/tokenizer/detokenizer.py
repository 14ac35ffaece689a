"""Incremental detokenisation: sampled token ids → new text, never half a UTF-8 character.

Where it sits: the engine keeps one :class:`IncrementalDetokenizer` per output sequence
and pushes each step's sampled ids; what ``push`` returns is the text to stream and to
check stop strings against. Works on the exact bytes of each token
(``Tokenizer.token_bytes``), so byte-level BPE (Llama 3, Qwen2, tiny) and sentencepiece
byte-fallback tokenizers (Llama 2, Mistral) split multi-byte characters the same way.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from kvfleet.engine.tokenizer.base import Tokenizer


@runtime_checkable
class _HasSpecialTokens(Protocol):
    @property
    def special_token_ids(self) -> frozenset[int]: ...


class IncrementalDetokenizer:
    """``push(ids)`` returns only the newly completed text; ``text`` is all of it so far.

    Special tokens (when the tokenizer names them, e.g. EOS) are skipped unless
    ``skip_special_tokens`` is False.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        # Invariant: every byte pushed is either already in ``text`` or buffered in the
        # decoder as the start of a character that is not complete yet.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip: frozenset[int] = frozenset()
        if skip_special_tokens and isinstance(tokenizer, _HasSpecialTokens):
            self._skip = tokenizer.special_token_ids
        self._parts: list[str] = []

    def push(self, token_ids: Iterable[int]) -> str:
        token_bytes, skip = self._tokenizer.token_bytes, self._skip
        data = b"".join([token_bytes(t) for t in token_ids if t not in skip])
        new = self._decoder.decode(data)
        if new:
            self._parts.append(new)
        return new

    def flush(self) -> str:
        """At the end of a sequence: whatever incomplete bytes are left, as U+FFFD."""
        new = self._decoder.decode(b"", final=True)
        if new:
            self._parts.append(new)
        return new

    @property
    def text(self) -> str:
        return "".join(self._parts)
