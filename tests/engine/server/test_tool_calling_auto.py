"""``tool_choice="auto"`` through the server with each registered parser, two calls in one message (issue #50).

The real tiny model (torch, CPU) is served once per parser (``--enable-auto-tool-choice
--tool-call-parser NAME``); ``guided_regex`` makes it write, exactly, that parser's format
for two parallel calls, so what is tested is the server: the parser named on the command
line reads the calls whole and streamed through the official ``openai`` client, each with its
own id, and both results go back in the history, where the rendered prompt must show them.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import httpx
import openai

from kvfleet.engine.server.tool_parsers import PARSERS

if TYPE_CHECKING:
    from conftest import LiveServer

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
QUESTION: list[Any] = [{"role": "user", "content": "Weather and time in Paris?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]


def _call(name: str, args: dict[str, Any], key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args})


# What each family's model writes for the two calls (the content before them, then the calls).
WRITTEN = {
    "hermes": ("Checking.\n", "".join(f"<tool_call>\n{_call(*c)}\n</tool_call>\n" for c in CALLS)),
    "qwen": ("", "".join(f"<tool_call>\n{_call(*c)}\n</tool_call>" for c in CALLS)),
    "llama3_json": ("", "; ".join(_call(*c, key="parameters") for c in CALLS)),
    "mistral": ("Checking. ", "[TOOL_CALLS] [" + ", ".join(_call(*c) for c in CALLS) + "]"),
    "openai": (
        "",
        "".join(  # gpt-oss's Harmony: a commentary message to each function, ended by <|call|>
            f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(args)}<|call|>"
            for name, args in CALLS
        ),
    ),
}
RESULTS = ['{"sky": "sunny", "celsius": 18}', '{"time": "14:05"}']


def test_every_registered_parser_has_its_written_calls_here() -> None:
    assert sorted(WRITTEN) == sorted(PARSERS)  # auto_tool_server serves each of PARSERS


def _asking(parser: str) -> dict[str, Any]:
    content, calls = WRITTEN[parser]
    return {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 300,
            "temperature": 0, "extra_body": {"guided_regex": re.escape(content + calls)}}  # fmt: skip


def _streamed(client: openai.OpenAI, parser: str) -> tuple[str, list[tuple[str, str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**_asking(parser), stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls, "a call's id came twice"
                    calls[d.index] = [d.id, d.function.name, ""]
                elif d.function and d.function.arguments:
                    calls[d.index][2] += d.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_auto_reads_two_calls_whole_and_streamed_and_both_results_reach_the_prompt(
    auto_tool_server: LiveServer,
) -> None:
    live = auto_tool_server
    parser = live.state.tools.parser
    assert parser is not None
    with live.openai_client() as client:
        whole = client.chat.completions.create(**_asking(parser)).choices[0]
        content, streamed, finish = _streamed(client, parser)
    calls = whole.message.tool_calls or []
    assert whole.finish_reason == "tool_calls" and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert [(name, json.loads(args)) for _, name, args in streamed] == CALLS
    assert (whole.message.content or "") == content == WRITTEN[parser][0]
    assert len({c.id for c in calls}) == 2 and len({i for i, _, _ in streamed}) == 2
    _answer_sees_both_results(live, [(c.id, c.function.name, c.function.arguments) for c in calls])


def _answer_sees_both_results(live: LiveServer, calls: list[tuple[str, str, str]]) -> None:
    """Both results go back; the answer's prompt is exactly the history /tokenize renders, results in it."""
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]}  # fmt: skip
    results = [
        {"role": "tool", "tool_call_id": i, "content": r} for (i, _, _), r in zip(calls, RESULTS, strict=True)
    ]
    history = [*QUESTION, called, *results]
    with live.openai_client() as client:
        answer = client.chat.completions.create(model="tiny", messages=history, max_tokens=1, temperature=0)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        rendered = c.post("/tokenize", json={"model": "tiny", "messages": history, "return_token_strs": True})
        without = c.post("/tokenize", json={"model": "tiny", "messages": [*QUESTION, called, results[0]]})
    text = "".join(rendered.json()["token_strs"])
    assert answer.usage is not None and answer.usage.prompt_tokens == rendered.json()["count"]
    assert rendered.json()["count"] > without.json()["count"]  # the second result is counted too
    for result in RESULTS:
        assert f"<tool_response>\n{result}\n</tool_response>" in text
