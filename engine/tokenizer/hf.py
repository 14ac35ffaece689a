"""Text ↔ token ids for a Hugging Face folder: ``tokenizer.json`` plus the chat template.

Where it sits: the server and ``LLM.generate`` encode prompts and render chats with
:class:`HFTokenizer`; the incremental detokeniser asks it for each token's exact bytes
(:meth:`HFTokenizer.token_bytes`). It implements the ``Tokenizer`` protocol of
``engine/runner/base.py``. Special tokens and EOS ids come from ``tokenizer_config.json``,
``generation_config.json`` and ``config.json`` (their union, as vLLM stops on any); the
chat template is rendered with jinja2 the way transformers renders it.

Chats are rendered to text that already holds the special tokens; encode that text with
``add_special_tokens=False`` (as transformers' ``apply_chat_template(tokenize=True)`` does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _RawTokenizer

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.tokenizer.base import Tokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the messages."""


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable stand-in character → the byte it encodes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with the Hugging Face folder's special tokens and chat template."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: tokenizer.json is missing (kvfleet needs the fast-tokenizer file)")
        try:
            self._tok = _RawTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({e})") from e
        self._decoder_kind = _decoder_kind(json.loads(path.read_text()).get("decoder"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        self.bos_token = _token_content(tok_config.get("bos_token"))
        self.eos_token = _token_content(tok_config.get("eos_token"))
        self.chat_template = _chat_template(folder, tok_config)
        self._special_tokens = {
            key: content
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(tok_config.get(key))) is not None
        }
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self._eos_ids = self._collect_eos(folder)
        self._bytes_cache: dict[int, bytes] = {}

    def _collect_eos(self, folder: Path) -> frozenset[int]:
        ids = _id_set(_read_json(folder / "generation_config.json").get("eos_token_id"))
        ids |= _id_set(_read_json(folder / "config.json").get("eos_token_id"))
        if self.eos_token is not None and (eos := self._tok.token_to_id(self.eos_token)) is not None:
            ids.add(eos)
        return frozenset(ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._compute_token_bytes(token_id)
        return cached

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if self._decoder_kind == "byte_level":
            table = _byte_decoder()
            return bytes(table[c] for c in piece)
        if self._decoder_kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        return str(self._tok.decode([token_id], skip_special_tokens=False)).encode()

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template takes ``tools`` (it names them), as tool-calling templates do."""
        return self.chat_template is not None and "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat as the template renders it; ``tools`` (OpenAI's tool objects) are handed to it as
        transformers hands them (a template that does not name them ignores them), and
        ``template_kwargs`` (a request's ``chat_template_kwargs``) as further variables."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json has none)")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                **dict(template_kwargs or {}),
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None if tools is None else [dict(t) for t in tools],
                **self._special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e


def _decoder_kind(decoder: Any) -> str:
    """``byte_level`` (GPT-2 alphabet), ``sentencepiece`` (▁ for space, <0xNN> byte fallback) or ``other``."""
    if not isinstance(decoder, dict):
        return "other"
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace", "Replace"}:
        return "sentencepiece"
    return "other"


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one serves chats
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers builds: sandboxed, trim/lstrip blocks, loop controls.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
