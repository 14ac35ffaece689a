"""A torch-free twin of the tiny model's byte-level tokenizer: one token per byte, plus ``<s>``, ``</s>``, ``<pad>``.

Where it sits: the simulated engine (``kvfleet engine --simulate``) encodes prompts and
renders chats with it, so a simulated process imports neither torch nor a model folder
(``HFTokenizer`` reads ``tokenizer.json`` through the model package, which loads torch).
It implements the ``Tokenizer`` protocol of ``engine/runner/base.py`` and gives the same
ids as the ``tiny`` model's tokenizer: token ``b`` (0-255) is the byte ``b``, then
``<s>`` 256, ``</s>`` 257 (EOS), ``<pad>`` 258, and the same chat template. A prompt of
N ASCII characters is therefore N tokens (plus BOS), which router tests can reason with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet.engine.tokenizer.base import Tokenizer

BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 256, 257, 258
SPECIAL_TOKENS = {BOS_TOKEN_ID: "<s>", EOS_TOKEN_ID: "</s>", PAD_TOKEN_ID: "<pad>"}
_SPECIAL_IDS = {text: token_id for token_id, text in SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile(
    "(" + "|".join(re.escape(t) for t in sorted(_SPECIAL_IDS, key=len, reverse=True)) + ")"
)


class ByteTokenizer(Tokenizer):
    bos_token_id = BOS_TOKEN_ID
    special_token_ids = frozenset(SPECIAL_TOKENS)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_TOKEN_ID})

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special tokens written in the text are single tokens (as Hugging Face's added tokens are).
        ids = [BOS_TOKEN_ID] if add_special_tokens else []
        for part in _SPECIAL_RE.split(text):
            if part in _SPECIAL_IDS:
                ids.append(_SPECIAL_IDS[part])
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in token_ids:
            if t in SPECIAL_TOKENS:
                if not skip_special_tokens:
                    out += SPECIAL_TOKENS[t].encode()
            else:
                out.append(t)
        return out.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token_id].encode()
        if not 0 <= token_id < 256:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return bytes([token_id])

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        # The tiny model's template: "<s>", then "<|role|>\ncontent\n" per message, then "<|assistant|>\n".
        text = "<s>" + "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")
