"""The vocabulary as xgrammar sees it, built from the engine's own tokenizer.

Where it sits: :class:`~kvfleet.engine.structured.StructuredOutputs` builds it once per engine.
Every tokenizer the engine serves (an HF ``tokenizer.json``, the GGUF-derived SmolLM2 folder,
the tiny model's byte-level one) answers ``token_bytes(id)`` with the exact bytes a token
stands for, so the vocabulary is given raw: no guessing of byte-level or sentencepiece
encodings. Special tokens, and ids the model's logits have beyond the tokenizer's vocabulary,
are given as empty strings, which xgrammar never allows (the stop tokens are allowed where the
grammar may end, whatever their text).
"""

from __future__ import annotations

from collections.abc import Iterable

import xgrammar as xgr

from kvfleet.engine.tokenizer.base import Tokenizer


def encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes for ids below ``vocab_size`` (the logits' width); b"" for special or absent ids."""
    special = frozenset(getattr(tokenizer, "special_token_ids", frozenset()))
    known = min(vocab_size, tokenizer.vocab_size)
    vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(known)]
    return vocab + [b""] * (vocab_size - known)


def tokenizer_info(vocab: list[bytes], stop_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=len(vocab),
        stop_token_ids=sorted(stop_token_ids),
    )
