"""The simulator's torch-free tokenizer gives the tiny model's tokenizer's ids, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer
from kvfleet.engine.tokenizer.hf import HFTokenizer

TEXTS = ["Hello, world!", "", "naïve 日本 🙂", "<s>inside</s> and <pad>", "a\nb\tc  d"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <s>"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder: Path = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    return HFTokenizer(folder)


def test_encoding_matches_the_tiny_tokenizer(tiny: HFTokenizer) -> None:
    ours = ByteTokenizer()
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == tiny.encode(
                text, add_special_tokens=special
            ), text
    assert (ours.vocab_size, ours.eos_token_ids) == (tiny.vocab_size, tiny.eos_token_ids)


def test_the_chat_template_and_the_token_bytes_match_the_tiny_tokenizer(tiny: HFTokenizer) -> None:
    ours = ByteTokenizer()
    assert ours.apply_chat_template(CHAT) == tiny.apply_chat_template(CHAT)
    for token_id in (0, 65, 200, 255, 256, 257):
        assert ours.token_bytes(token_id) == tiny.token_bytes(token_id)
    ids = ours.encode("naïve <s>", add_special_tokens=True)
    assert ours.decode(ids) == tiny.decode(ids) == "naïve "
    assert ours.decode(ids, skip_special_tokens=False) == tiny.decode(ids, skip_special_tokens=False)
