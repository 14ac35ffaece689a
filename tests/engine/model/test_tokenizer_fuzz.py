"""Property: any unicode text survives encode → decode, and streamed detokenisation, on tiny and on SmolLM2.

Hypothesis draws arbitrary text (every category but lone surrogates, which no UTF-8 text
holds: the servers refuse them with a 400); decoding the ids gives the text back, and
pushing the ids one at a time through the incremental detokenizer, then flushing, gives
exactly the whole decode, never half a character on the way.

SmolLM2's byte-level vocabulary lacks a few byte tokens (0xF1 among them: U+40000..U+7FFFF
start with it), and its tokenizer drops such bytes, in transformers as here; for SmolLM2 the
ids must equal transformers' for every text, and the round trip be exact wherever the
vocabulary holds every byte of the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.engine.loader.sources import resolve_model, smollm2_gguf
from kvfleet.engine.tokenizer.detokenizer import IncrementalDetokenizer
from kvfleet.engine.tokenizer.hf import HFTokenizer

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=48)
SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


def _streamed(tokenizer: HFTokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


def _check_round_trip(tokenizer: HFTokenizer, text: str, ids: list[int]) -> None:
    whole = tokenizer.decode(ids)
    pieces = _streamed(tokenizer, ids)
    assert "".join(pieces) == whole
    if b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode():  # every byte has its token
        assert whole == text
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text  # never half a character


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> HFTokenizer:
    return HFTokenizer(tiny_dir)


def test_any_text_round_trips_through_the_tiny_tokenizer_whole_and_streamed(tiny: HFTokenizer) -> None:
    @given(text=TEXT)
    @SETTINGS
    def check(text: str) -> None:
        ids = tiny.encode(text, add_special_tokens=False)
        assert len(ids) == len(text.encode())  # one id per byte: nothing is dropped
        _check_round_trip(tiny, text, ids)

    check()


@pytest.fixture(scope="module")
def smollm2() -> tuple[HFTokenizer, Any]:
    """Ours and transformers' tokenizer of the same GGUF (fetched once into the kvfleet cache)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return HFTokenizer(resolve_model("smollm2")), AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name
    )


@pytest.mark.slow
def test_any_text_round_trips_through_smollm2s_tokenizer_whole_and_streamed(
    smollm2: tuple[HFTokenizer, Any],
) -> None:
    ours, reference = smollm2

    @given(text=TEXT)
    @SETTINGS
    def check(text: str) -> None:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids)
        _check_round_trip(ours, text, ids)

    check()
