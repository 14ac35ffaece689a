"""What the engine and the server ask of a tokenizer: the base class of the two real ones.

Where it sits: :class:`~kvfleet.engine.tokenizer.hf.HFTokenizer` (a Hugging Face folder) and
:class:`~kvfleet.engine.tokenizer.byte_level.ByteTokenizer` (the simulated engine's byte-level twin)
implement it; the server encodes prompts and renders chats with it, the engine core's detokenizer
turns sampled ids back into text with :meth:`Tokenizer.token_bytes`. Torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any


class Tokenizer(ABC):
    """Text ↔ token ids, the exact bytes of one token, and the model's chat template."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation (``eos_token_id`` of the config and the generation config)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """How many ids the tokenizer knows, added tokens included."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text`` (with the beginning-of-sequence token when the model adds one)."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``, all at once."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (for incremental, UTF-8-safe detokenisation)."""

    @abstractmethod
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the model's chat template renders from ``messages``."""
