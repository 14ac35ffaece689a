"""OpenAI's Harmony format (gpt-oss): the model's output read into messages, and a conversation rendered as Harmony.

Where it sits: the ``openai_gptoss`` reasoning parser (:mod:`kvfleet.engine.server.reasoning.gptoss`)
and the ``openai`` tool-call parser (:mod:`kvfleet.engine.server.tool_parsers.openai`) read the
text a gpt-oss model writes after its prompt's ``<|start|>assistant`` with :func:`read_messages`;
``engine/server/chat_prompt.py`` renders a chat with :func:`render_conversation` when the model's
tokenizer has no chat template of its own (gpt-oss ships one that writes the same text). A message::

    <|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]<|message|>BODY<|end|>

ends in ``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the answer is done); the first
message of an output has no ``<|start|>assistant``, the prompt wrote it. The channels: ``analysis``
(reasoning), ``commentary`` (tool calls, to ``functions.NAME``, or a preamble to the user) and
``final`` (the answer). The markers are special tokens of the gpt-oss tokenizer, so its output is
detokenised keeping them (``skip_special_tokens`` false).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDINGS = (END, CALL, RETURN)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDINGS)
FUNCTIONS = "functions."


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


@dataclass(frozen=True)
class HarmonyMessage:
    role: str
    channel: str | None
    recipient: str | None  # "functions.get_weather" for a tool call; None: to the user
    content_type: str | None  # "json" (``<|constrain|>json``) or None
    text: str  # the body so far (a marker that may be starting is held back)
    complete: bool  # its ending marker came (or the output ended)
    span: tuple[int, int]  # where the message (header included) lies in the output text

    @property
    def function(self) -> str | None:
        """The function this message calls (``to=functions.NAME``), None when it calls none."""
        r = self.recipient
        if not r or r.startswith("<|") or r == "assistant":
            return None
        name = r.removeprefix(FUNCTIONS)
        return name or None


def _header(header: str) -> tuple[str, str | None, str | None, str | None]:
    """(role, channel, recipient, content type) of the text between ``<|start|>`` and ``<|message|>``."""
    before, _, after = header.replace(CONSTRAIN, " ").partition(CHANNEL)
    words, recipient = before.split(), None
    role = "assistant"
    for w in words:
        if w.startswith("to="):
            recipient = w[3:]
        else:
            role = w
    rest = after.split()
    channel = rest[0] if rest else None
    content_type = None
    for w in rest[1:]:
        if w.startswith("to="):
            recipient = w[3:]
        else:
            content_type = w
    return role, channel, recipient, content_type


# Invariant: ``pos`` is where the next message's header starts; every message before it was read whole.
def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of ``text`` so far. A header still arriving is no message yet; the last body holds
    back a marker that may be starting unless ``final``. Finished text with no header at all (a model
    that did not write Harmony) is one ``final`` message."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        head = pos + len(START) if text.startswith(START, pos) else pos
        body = text.find(MESSAGE, head)
        if body < 0:
            break
        role, channel, recipient, content_type = _header(text[head:body])
        body += len(MESSAGE)
        ends = [(i, m) for m in ENDINGS if (i := text.find(m, body)) >= 0]
        if ends:
            stop, marker = min(ends)
            messages.append(
                HarmonyMessage(
                    role, channel, recipient, content_type, text[body:stop], True, (pos, stop + len(marker))
                )  # fmt: skip
            )
            pos = stop + len(marker)
            continue
        hold = 0 if final else max(held_back(text, m) for m in MARKERS)
        messages.append(
            HarmonyMessage(
                role, channel, recipient, content_type, text[body : len(text) - hold], final, (pos, len(text))
            )  # fmt: skip
        )
        break
    if final and not messages and text and not any(m in text for m in MARKERS):
        messages.append(HarmonyMessage("assistant", "final", None, None, text, True, (0, len(text))))
    return messages


def is_reasoning(m: HarmonyMessage) -> bool:
    return m.channel == "analysis" and m.function is None


def is_content(m: HarmonyMessage) -> bool:
    """A message to the user: the ``final`` channel, or a ``commentary`` preamble to no one."""
    return m.function is None and (m.channel == "final" or (m.channel == "commentary" and not m.recipient))


def joined(texts: Sequence[str]) -> str:
    """Messages' texts as vLLM joins them (a newline between messages)."""
    return "\n".join(texts)


# Rendering: the text gpt-oss's own chat template writes, for a tokenizer that ships none.
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def render_conversation(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat as Harmony: a system message (identity, dates, reasoning effort, the channels), a
    developer message (the first system/developer message's instructions and the tools), then the
    turns; an assistant's ``reasoning`` shows only on a tool-call turn no later answer followed."""
    kw = dict(kwargs or {})
    out = [_system(kw.get("model_identity", IDENTITY), kw.get("reasoning_effort") or "medium", bool(tools))]
    turns = list(messages)
    instructions = ""
    if turns and turns[0]["role"] in ("system", "developer"):
        instructions, turns = turns[0].get("content") or "", turns[1:]
    if instructions or tools:
        dev = f"# Instructions\n\n{instructions}\n\n" if instructions else ""
        if tools:
            dev += "# Tools\n\n" + _namespace(tools)
        out.append(f"{START}developer{MESSAGE}{dev}{END}")
    last_call: str | None = None
    for i, m in enumerate(turns):
        if m["role"] == "assistant" and m.get("tool_calls"):
            call = m["tool_calls"][0]["function"]
            answered = any(t["role"] == "assistant" and not t.get("tool_calls") for t in turns[i + 1 :])
            thought = m.get("content") or m.get("reasoning_content") or ""
            if thought and not answered:
                out.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{thought}{END}")
            out.append(f"{START}assistant to={FUNCTIONS}{call['name']}{CHANNEL}commentary json{MESSAGE}"
                       f"{json.dumps(call['arguments'], ensure_ascii=False)}{CALL}")  # fmt: skip
            last_call = call["name"]
        elif m["role"] == "assistant":
            out.append(f"{START}assistant{CHANNEL}final{MESSAGE}{m.get('content') or ''}{END}")
            last_call = None
        elif m["role"] == "tool":
            if last_call is None:
                raise ValueError("a tool message follows no assistant tool call")
            result = json.dumps(m.get("content") or "", ensure_ascii=False)
            out.append(f"{START}{FUNCTIONS}{last_call} to=assistant{CHANNEL}commentary{MESSAGE}{result}{END}")
        else:
            out.append(f"{START}user{MESSAGE}{m.get('content') or ''}{END}")
    return "".join(out) + (f"{START}assistant" if add_generation_prompt else "")


def _system(identity: str, effort: str, tools: bool) -> str:
    text = (f"{identity}\nKnowledge cutoff: 2024-06\nCurrent date: {time.strftime('%Y-%m-%d')}\n\n"
            f"Reasoning: {effort}\n\n# Valid channels: analysis, commentary, final. "
            "Channel must be included for every message.")  # fmt: skip
    if tools:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return f"{START}system{MESSAGE}{text}{END}"


def _namespace(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools as the TypeScript-like namespace Harmony declares functions in."""
    out = ["## functions\n\nnamespace functions {\n\n"]
    for t in tools:
        f = t["function"]
        out.append(f"// {f.get('description') or ''}\ntype {f['name']} = ")
        props = (f.get("parameters") or {}).get("properties") or {}
        if not props:
            out.append("() => any;\n\n")
            continue
        required = (f.get("parameters") or {}).get("required") or []
        out.append("(_: {\n")
        for name, spec in props.items():
            if spec.get("description"):
                out.append(f"// {spec['description']}\n")
            out.append(f"{name}{'' if name in required else '?'}: {_ts_type(spec)}")
            if "default" in spec:  # as the template: an enum's default bare, another as JSON
                default = spec["default"] if spec.get("enum") else json.dumps(spec["default"])
                out.append(f", // default: {default}")
            out.append(",\n")
        out.append("}) => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


def _ts_type(spec: Mapping[str, Any]) -> str:
    kind = spec.get("type")
    if kind == "string" and spec.get("enum"):
        return '"' + '" | "'.join(spec["enum"]) + '"'
    if kind == "array":
        item = spec.get("items") or {}
        return f"{_ts_type(item)}[]" if item else "any[]"
    return {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
            "object": "object"}.get(kind or "", "any")  # fmt: skip
