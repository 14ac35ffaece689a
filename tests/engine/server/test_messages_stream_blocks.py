"""A streamed message's content blocks as a tool parser reads the output: text, then each call as its own
``tool_use`` block, opened and closed once, numbered in order (``engine/server/routes/messages.py``)."""

from __future__ import annotations

import json
from typing import Any

from kvfleet.engine.server.routes.messages import StreamBlocks, tool_events
from kvfleet.engine.server.tool_parsers import get_parser

OUTPUT = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
)


def _events(pieces: list[str]) -> list[dict[str, Any]]:
    blocks, stream = StreamBlocks(), get_parser("hermes").stream()
    out = [
        e for i, p in enumerate(pieces) for e in tool_events(blocks, stream, p, final=i == len(pieces) - 1)
    ]
    out += blocks.close()
    parsed = []
    for event in out:
        kind, data = event.removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        parsed.append(payload)
    return parsed


def test_text_then_two_calls_are_three_blocks_each_started_and_stopped_once() -> None:
    events = _events([OUTPUT[i : i + 7] for i in range(0, len(OUTPUT), 7)])  # 7-character deltas
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    assert [s["index"] for s in starts] == stops == [0, 1, 2]
    assert [(s["content_block"]["name"], s["content_block"]["input"]) for s in starts[1:]] == [
        ("get_weather", {}), ("get_time", {})
    ]  # fmt: skip
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    text = "".join(d["delta"]["text"] for d in deltas if d["index"] == 0)
    assert text.strip() == "Let me check."
    for index, expected in ((1, {"city": "Paris"}), (2, {"city": "Rome"})):
        parts = [d["delta"] for d in deltas if d["index"] == index]
        assert all(p["type"] == "input_json_delta" for p in parts)
        assert json.loads("".join(p["partial_json"] for p in parts)) == expected


def test_plain_text_is_one_text_block_and_no_text_is_no_block() -> None:
    blocks = StreamBlocks()
    events = [*blocks.text("ab"), *blocks.text(""), *blocks.text("c"), *blocks.close()]
    assert [e.split("\n")[0] for e in events] == [
        "event: content_block_start", "event: content_block_delta", "event: content_block_delta",
        "event: content_block_stop",
    ]  # fmt: skip
    assert StreamBlocks().close() == []
