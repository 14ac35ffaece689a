"""A chat's prompt: messages and tools through the model's chat template, or Hermes's tool prompt around it.

Where it sits: the chat route (and ``/tokenize``) call :func:`chat_prompt_ids`. A template
that mentions ``tools`` (Qwen 2.5, Llama 3.1, Hermes, Mistral) gets the tools, the assistant
``tool_calls`` and the ``tool`` messages as transformers hands them over. A template that
does not (SmolLM2's plain ChatML) would drop the tools, so the chat is rewritten first the
way Hermes-format templates (Qwen 2.5's) render it, and the model answers in the format the
``hermes`` parser reads:

* the tools go into the system message (appended to the first one, or a new one first): a
  ``# Tools`` block listing each tool's JSON in ``<tools></tools>`` and asking for calls as
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``;
* an assistant message's ``tool_calls`` become those ``<tool_call>`` blocks after its content;
* consecutive ``tool`` messages become one ``user`` message of ``<tool_response>`` blocks
  (a role every template accepts).

A request's ``chat_template_kwargs`` (and ``reasoning_effort``) go to the template as variables
(Qwen3's ``enable_thinking``). A gpt-oss model served with the Harmony parsers
(``--reasoning-parser openai_gptoss`` or ``--tool-call-parser openai``) whose tokenizer ships no
chat template gets the Harmony its template would write (:mod:`kvfleet.engine.server.harmony`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet.engine.server.harmony import render_conversation
from kvfleet.engine.server.state import ServerState
from kvfleet.engine.tokenizer.hf import HFTokenizer
from kvfleet.openai_api import APIError

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def chat_prompt_ids(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    text = chat_text(state, messages, tools, template_kwargs)
    return state.tokenizer.encode(text, add_special_tokens=False)


def chat_text(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a chat (``/tokenize`` renders it too); a template's refusal is a 400."""
    tok, kwargs, prompt = state.tokenizer, template_kwargs or {}, add_generation_prompt
    harmony = state.tools.reasoning_parser == "openai_gptoss" or state.tools.parser == "openai"
    try:
        if isinstance(tok, HFTokenizer) and tok.chat_template is None and harmony:
            return render_conversation(messages, tools, kwargs, add_generation_prompt=prompt)
        if isinstance(tok, HFTokenizer):
            chat, given = (
                (messages, tools) if tok.template_renders_tools else (hermes_messages(messages, tools), None)
            )
            return tok.apply_chat_template(
                chat, add_generation_prompt=prompt, tools=given, template_kwargs=kwargs
            )
        return tok.apply_chat_template(hermes_messages(messages, tools), add_generation_prompt=prompt)
    except ValueError as exc:  # ChatTemplateError: no template, or it refused the messages
        raise APIError(400, f"messages: {exc}", param="messages") from None


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The chat as plain role/content messages, tools and tool turns written in Hermes's format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
        elif m.get("tool_calls"):
            calls = [_call_block(c["function"]) for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), *calls]))})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("tool_responses", None)
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_block(function: Mapping[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
