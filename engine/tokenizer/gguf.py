"""A GGUF file's tokenizer metadata (``tokenizer.ggml.*``) as Hugging Face tokenizer files.

Where it sits: :mod:`kvfleet.engine.loader.gguf_convert` calls :func:`tokenizer_files` while it
builds a model folder from a GGUF checkpoint; the folder's ``tokenizer.json`` and
``tokenizer_config.json`` are then read by :class:`~kvfleet.engine.tokenizer.hf.HFTokenizer`
like any checkpoint's. Torch-free: the API process runs it to get its tokenizer.

Two vocabularies are rebuilt, as transformers rebuilds them from a GGUF: ``gpt2`` (byte-level
BPE: the tokens, the merges, a pre-tokenizer split picked by ``tokenizer.ggml.pre``) and
``llama`` (sentencepiece BPE with byte fallback, merges recovered from the token scores).
Tokens typed CONTROL become special added tokens, USER_DEFINED ones plain added tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.tokenizer.hf import _byte_decoder

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SUPPORTED_TOKENIZERS = ("gpt2", "llama")

# The split each byte-level vocabulary's merges were learned with (llama.cpp's ``tokenizer.ggml.pre``).
# Anything else gets GPT-2's own regex (the ByteLevel pre-tokenizer's), as transformers gives it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class TokenizerFiles(NamedTuple):
    tokenizer_json: dict[str, Any]
    tokenizer_config: dict[str, Any]


class TokenizerMeta(NamedTuple):
    """The ``tokenizer.*`` fields of a GGUF file, read by the converter."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    special_ids: dict[str, int]  # bos_token / eos_token / unk_token / pad_token → id
    add_bos: bool
    add_space_prefix: bool  # sentencepiece: "hello" is tokenised as " hello"
    chat_template: str | None


def tokenizer_files(meta: TokenizerMeta, source: str, max_len: int) -> TokenizerFiles:
    """``tokenizer.json`` and ``tokenizer_config.json`` for the vocabulary ``meta`` describes."""
    if meta.model == "gpt2":
        tokens = _byte_level_spelling(meta.tokens)
        body = _byte_level_json(meta, tokens)
    elif meta.model == "llama":
        tokens = meta.tokens
        body = _sentencepiece_json(meta)
    else:
        raise ModelLoadError(
            f"{source}: field tokenizer.ggml.model is {meta.model!r}; supported: {list(SUPPORTED_TOKENIZERS)}"
        )
    for key, token_id in meta.special_ids.items():
        if not 0 <= token_id < len(tokens):
            raise ModelLoadError(
                f"{source}: field tokenizer.ggml.{key} is {token_id}, outside the {len(tokens)}-token vocabulary"
            )
    specials = {key: tokens[token_id] for key, token_id in meta.special_ids.items()}
    body["added_tokens"] = _added_tokens(meta, tokens)
    bos_id = meta.special_ids.get("bos_token") if meta.add_bos else None
    body["post_processor"] = _post_processor(None if bos_id is None else (tokens[bos_id], bos_id))
    config: dict[str, Any] = {
        **specials,
        "add_bos_token": meta.add_bos,
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if meta.chat_template is not None:
        config["chat_template"] = meta.chat_template
    return TokenizerFiles(body, config)


def _byte_level_spelling(tokens: Sequence[str]) -> list[str]:
    """Every token in GPT-2's byte alphabet (a file may spell a token as its plain UTF-8 text)."""
    alphabet = _byte_decoder()
    spelling = {b: c for c, b in alphabet.items()}
    return [
        t if all(c in alphabet for c in t) else "".join(spelling[b] for b in t.encode("utf-8"))
        for t in tokens
    ]


def _byte_level_json(meta: TokenizerMeta, tokens: list[str]) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    pre: dict[str, Any] = byte_level
    split = _SPLITS.get(meta.pre or "")
    if split is not None:
        pre = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                {**byte_level, "use_regex": False},
            ],
        }
    return _json_body(
        normalizer=None,
        pre_tokenizer=pre,
        decoder=byte_level,
        model=_bpe(tokens, [m.split(" ", 1) for m in meta.merges], byte_fallback=False, unk=None),
    )


def _sentencepiece_json(meta: TokenizerMeta) -> dict[str, Any]:
    """transformers' ``LlamaTokenizer``: Metaspace (a prefix space unless the file says not), byte fallback."""
    merges = [m.split(" ", 1) for m in meta.merges] if meta.merges else _merges_from_scores(meta)
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if meta.add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    scheme = "first" if meta.add_space_prefix else "never"
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": False}
    return _json_body(
        normalizer=None,
        pre_tokenizer=metaspace,
        decoder={"type": "Sequence", "decoders": decoders},
        model=_bpe(meta.tokens, merges, byte_fallback=True, unk=None),
    )


def _merges_from_scores(meta: TokenizerMeta) -> list[list[str]]:
    """Sentencepiece stores no merges: every split of a token into two tokens, in transformers' order
    (``generate_merges``: the merged token's score, then the longer left and right piece first)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(meta.tokens):
        vocab.setdefault(token, index)
    scores = dict(zip(meta.tokens, meta.scores or [0.0] * len(meta.tokens), strict=False))
    found: list[tuple[float, str, str]] = []
    for token, score in scores.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        local = sorted(
            (p for p in pairs if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]])
        )
        found.extend((score, left, right) for left, right in local)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [[left, right] for _, left, right in found]


def _bpe(
    tokens: list[str], merges: list[list[str]], *, byte_fallback: bool, unk: str | None
) -> dict[str, Any]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicate spelling keeps its first id, as a dict-built vocab does
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": merges,
    }


def _json_body(**parts: Any) -> dict[str, Any]:
    return {"version": "1.0", "truncation": None, "padding": None, **parts}


def _added_tokens(meta: TokenizerMeta, tokens: list[str]) -> list[dict[str, Any]]:
    alphabet = _byte_decoder()
    added = []
    for index, (token, kind) in enumerate(zip(tokens, meta.token_types, strict=False)):
        # a byte-level token spelled outside the byte alphabet is a llama.cpp mislabel: transformers skips it too
        if meta.model == "gpt2" and any(c not in alphabet for c in meta.tokens[index]):
            continue
        if kind in (CONTROL, USER_DEFINED):
            added.append(added_token(index, token, special=kind == CONTROL))
    return added


def added_token(token_id: int, content: str, *, special: bool = True) -> dict[str, Any]:
    """One entry of tokenizer.json's ``added_tokens``."""
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _post_processor(bos: tuple[str, int] | None) -> dict[str, Any]:
    """BOS before the text when the file asks for it (``tokenizer.ggml.add_bos_token``), else nothing."""
    if bos is None:
        prefix: list[dict[str, Any]] = []
        specials: dict[str, Any] = {}
    else:
        token, token_id = bos
        prefix = [{"SpecialToken": {"id": token, "type_id": 0}}]
        specials = {token: {"id": token, "ids": [token_id], "tokens": [token]}}
    return {
        "type": "TemplateProcessing",
        "single": [*prefix, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [*prefix, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": specials,
    }
