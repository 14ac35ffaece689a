"""The tokenizer wrapper (special tokens, EOS, chat template) and the UTF-8-safe incremental detokeniser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer

from kvfleet.engine.tokenizer.detokenizer import IncrementalDetokenizer
from kvfleet.engine.tokenizer.hf import ChatTemplateError, HFTokenizer

TEXT = "héllo 🙂 世界!"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi 🙂"},
]


def test_the_tiny_tokenizer_maps_each_byte_to_its_own_id_after_bos(tiny_dir: Path) -> None:
    tok = HFTokenizer(tiny_dir)
    assert tok.encode("Hé") == [256, 72, 0xC3, 0xA9]
    assert tok.encode("Hé", add_special_tokens=False) == [72, 0xC3, 0xA9]
    assert tok.decode([256, 72, 0xC3, 0xA9, 257]) == "Hé"
    assert tok.eos_token_ids == frozenset({257})
    assert tok.vocab_size == 259
    assert [tok.token_bytes(i) for i in (72, 0xC3, 32, 257)] == [b"H", b"\xc3", b" ", b"</s>"]


def test_the_chat_template_renders_as_transformers_renders_it(tiny_dir: Path) -> None:
    ours = HFTokenizer(tiny_dir)
    theirs = AutoTokenizer.from_pretrained(tiny_dir)
    for add in (True, False):
        expected = theirs.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == expected
    assert ours.apply_chat_template(MESSAGES) == "<s><|system|>\nbe brief\n<|user|>\nhi 🙂\n<|assistant|>\n"


def test_encoding_agrees_with_the_transformers_fast_tokenizer(tiny_dir: Path) -> None:
    theirs = AutoTokenizer.from_pretrained(tiny_dir)
    assert HFTokenizer(tiny_dir).encode(TEXT) == theirs(TEXT)["input_ids"]


def test_a_model_without_a_chat_template_says_so(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        HFTokenizer(tmp_path).apply_chat_template(MESSAGES)


def test_eos_ids_are_the_union_of_generation_config_config_and_tokenizer_config(
    tiny_dir: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 11]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 12}))
    assert HFTokenizer(tmp_path).eos_token_ids == frozenset({10, 11, 12, 257})


def test_pushing_one_byte_at_a_time_never_yields_half_a_character(tiny_dir: Path) -> None:
    tok = HFTokenizer(tiny_dir)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in tok.encode(TEXT, add_special_tokens=False)]
    assert "".join(pieces) == TEXT == detok.text
    # the emoji is 4 bytes: three pushes yield nothing, the fourth the whole character
    emoji_start = len("héllo ".encode())
    assert pieces[emoji_start : emoji_start + 4] == ["", "", "", "🙂"]
    assert pieces[-7:] == ["", "", "世", "", "", "界", "!"]


def test_special_tokens_are_skipped_unless_asked_for(tiny_dir: Path) -> None:
    tok = HFTokenizer(tiny_dir)
    assert IncrementalDetokenizer(tok).push([72, 105, 257]) == "Hi"
    assert IncrementalDetokenizer(tok, skip_special_tokens=False).push([72, 105, 257]) == "Hi</s>"


def test_an_unfinished_character_at_the_end_flushes_as_a_replacement_character(tiny_dir: Path) -> None:
    detok = IncrementalDetokenizer(HFTokenizer(tiny_dir))
    assert detok.push([72, 0xE4, 0xB8]) == "H"
    assert detok.flush() == "\ufffd"
    assert detok.text == "H\ufffd"


def sentencepiece_style_folder(folder: Path) -> Path:
    """A Llama-2-style tokenizer: ▁ for spaces, whole CJK pieces, <0xNN> byte fallback for the rest."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    merges = [("▁", "h"), ("▁h", "i"), ("▁", "世"), ("▁世", "界")]
    for piece in ("▁", "h", "i", "世", "界", "▁h", "▁hi", "▁世", "▁世界"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_sentencepiece_byte_fallback_pieces_join_into_whole_characters(tmp_path: Path) -> None:
    tok = HFTokenizer(sentencepiece_style_folder(tmp_path))
    hi, world = tok.encode("hi 世界", add_special_tokens=False)
    assert tok.decode([hi, world]) == "hi 世界"
    emoji = [3 + b for b in "🙂".encode()]
    assert tok.token_bytes(hi) == b" hi" and tok.token_bytes(emoji[0]) == b"\xf0"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in [hi, world, *emoji]] == [" hi", " 世界", "", "", "", "🙂"]
