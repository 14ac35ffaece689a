"""The chat templates of the new families (templates/: Qwen3's and Gemma 3's, in the structure their
hub repositories ship: namespaces, reversed slices, think-block splitting, role alternation errors)
render through kvfleet's tokenizer exactly as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvfleet.engine.tokenizer.hf import ChatTemplateError, HFTokenizer

TEMPLATES = Path(__file__).parent / "templates"
CHATS = [
    [{"role": "user", "content": "  héllo 🙂  "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


def with_template(tiny_dir: Path, tmp_path: Path, family: str) -> Path:
    folder = tmp_path / family
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{family}.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_familys_chat_template_renders_as_transformers_renders_it(
    family: str, tiny_dir: Path, tmp_path: Path
) -> None:
    folder = with_template(tiny_dir, tmp_path, family)
    ours, theirs = HFTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for chat in CHATS:
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(chat) == expected
        assert ours.encode(expected, add_special_tokens=False) == theirs.encode(
            expected, add_special_tokens=False
        )


def test_gemma3s_template_refuses_roles_that_do_not_alternate_as_transformers_does(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = with_template(tiny_dir, tmp_path, "gemma3")
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        HFTokenizer(folder).apply_chat_template(chat)
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False)
