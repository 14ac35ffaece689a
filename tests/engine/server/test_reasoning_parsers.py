"""Each reasoning parser and the ``openai`` (Harmony) tool-call parser, whole and streamed at any split.

A stream is fed the text one character at a time and in random pieces; what it sends, joined,
must be what the whole text's parse reads, in OpenAI's order (reasoning before content).
"""

from __future__ import annotations

import argparse
import json
import random
from itertools import count
from typing import get_args

import pytest

from kvfleet.engine import cli
from kvfleet.engine.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from kvfleet.engine.server.reasoning.base import OutputEvent, OutputReader, ReasoningDelta, Split
from kvfleet.engine.server.tool_parsers import get_parser
from kvfleet.engine.server.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCall,
    ParsedOutput,
    ToolParser,
)
from kvfleet.engine.server.tool_parsers.openai import OpenAIParser
from kvfleet.resources import ReasoningParserName

QWEN3 = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
ANALYSIS = "<|channel|>analysis<|message|>User asks weather. Call get_weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 C in Paris.<|return|>"


def engine_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(flags))


def numbered(parser: ToolParser) -> ToolParser:
    ids = count()
    parser.new_call_id = lambda: f"id{next(ids)}"  # type: ignore[method-assign]
    return parser


def pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random places (seed 0: one character at a time)."""
    if seed == 0:
        return list(text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def read(reasoning: str | None, tools: str | None, parts: list[str], **kwargs: object) -> list[OutputEvent]:
    parser = None if reasoning is None else get_reasoning_parser(reasoning, kwargs)
    reader = OutputReader(parser, None if tools is None else numbered(get_parser(tools)), keep_reasoning=True)
    events = [e for p in parts for e in reader.feed(p)]
    return events + reader.feed("", final=True)


def joined(events: list[OutputEvent]) -> tuple[str, str, list[str], str]:
    """(reasoning, content, call names, arguments) the events carry, checking reasoning comes first."""
    kinds = [type(e) for e in events]
    if ReasoningDelta in kinds and len(set(kinds)) > 1:
        assert max(i for i, k in enumerate(kinds) if k is ReasoningDelta) < min(
            i for i, k in enumerate(kinds) if k is not ReasoningDelta
        ), "a reasoning delta came after content"
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, ContentDelta)),
        [e.name for e in events if isinstance(e, CallStart)],
        "".join(e.text for e in events if isinstance(e, ArgumentsDelta)),
    )


def test_the_reasoning_parsers_are_registered_by_vllms_names() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "openai_gptoss", "qwen3"]
    with pytest.raises(
        ValueError, match=r"unknown parser 'r1'; known: \['deepseek_r1', 'openai_gptoss', 'qwen3'\]"
    ):
        get_reasoning_parser("r1")


def test_the_operators_spec_names_the_same_parsers() -> None:
    assert sorted(get_args(ReasoningParserName)) == sorted(REASONING_PARSERS)


def test_an_unknown_reasoning_parser_flag_is_refused_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        engine_args("--reasoning-parser", "granite")
    assert (
        "--reasoning-parser: invalid choice: 'granite' (choose from 'deepseek_r1', 'openai_gptoss', 'qwen3')"
        in (capsys.readouterr().err)
    )


def test_qwen3_splits_the_thinking_from_the_answer() -> None:
    assert get_reasoning_parser("qwen3").split(QWEN3, final=True) == Split(
        "\nThe user greets me.\n", "\n\nHello! How can I help?"
    )


def test_qwen3_reads_reasoning_whose_opening_tag_the_template_wrote() -> None:
    assert get_reasoning_parser("qwen3").split("Hmm.</think>Hi", final=True) == Split("Hmm.", "Hi")


def test_a_text_that_never_closes_its_thinking_is_all_reasoning() -> None:
    assert get_reasoning_parser("deepseek_r1").split("<think>cut off", final=True) == Split("cut off", "")


def test_qwen3_with_thinking_off_reads_everything_as_content() -> None:
    parser = get_reasoning_parser("qwen3", {"enable_thinking": False})
    assert parser.split("<think>no</think>yes", final=True) == Split("", "<think>no</think>yes")


# Streams read at any split: (reasoning parser, tool parser, text, splits tried) and what the whole text
# reads as, (reasoning, content, call names, call arguments).
WHOLE_READS = {
    "qwen3": (("qwen3", None, QWEN3, 25), ("\nThe user greets me.\n", "\n\nHello! How can I help?", [], "")),
    "gptoss-reasoning-then-call": (
        ("openai_gptoss", "openai", ANALYSIS + CALL, 40),
        ("User asks weather. Call get_weather.", "", ["get_weather"], '{"city": "Paris"}'),
    ),
    "gptoss-reasoning-then-answer-without-tools": (
        (
            "openai_gptoss",
            None,
            ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL,
            40,
        ),
        ("User asks weather. Call get_weather.\nMore.", "It is 18 C in Paris.", [], ""),
    ),
}


@pytest.mark.parametrize(
    ("case", "seed"),
    [(case, seed) for case, ((*_, splits), _) in WHOLE_READS.items() for seed in range(splits)],
)
def test_a_stream_reads_at_any_split_what_the_whole_text_reads(case: str, seed: int) -> None:
    (reasoning, tools, text, _), whole = WHOLE_READS[case]
    assert joined(read(reasoning, tools, pieces(text, seed))) == whole


def test_qwen3_holds_back_what_may_be_a_closing_tag_then_releases_it() -> None:
    reader = OutputReader(get_reasoning_parser("qwen3"), None, keep_reasoning=True)
    assert reader.feed("<think>a</th") == [ReasoningDelta("a")]
    assert reader.feed("ey") == [ReasoningDelta("</they")]


@pytest.mark.parametrize("seed", range(0, 25))
def test_qwen3_reasoning_then_a_hermes_call_at_any_split(seed: int) -> None:
    text = 'Let me look.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reasoning, content, names, arguments = joined(read("qwen3", "hermes", pieces(text, seed)))
    assert (reasoning, content, names, json.loads(arguments)) == (
        "Let me look.",
        "\n",
        ["get_weather"],
        {"city": "Paris"},
    )


def test_gptoss_splits_analysis_from_the_final_answer() -> None:
    split = get_reasoning_parser("openai_gptoss").split(ANALYSIS + FINAL, final=True)
    assert split.reasoning == "User asks weather. Call get_weather."
    assert get_parser("openai").parse(split.content) == ParsedOutput("It is 18 C in Paris.", [])


def test_the_openai_parser_reads_a_commentary_call_to_a_function() -> None:
    assert numbered(get_parser("openai")).parse(ANALYSIS + CALL) == ParsedOutput(
        None, [ParsedCall("id0", "get_weather", '{"city": "Paris"}')]
    )


def test_a_call_cut_before_its_call_token_is_still_a_call() -> None:
    # <|call|> is one of gpt-oss's stop tokens: the text the engine returns may end before it
    output = numbered(OpenAIParser()).parse(ANALYSIS + CALL.removesuffix("<|call|>"))
    assert output.calls == [ParsedCall("id0", "get_weather", '{"city": "Paris"}')]


def test_the_recipient_may_come_before_the_channel() -> None:
    legacy = (
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>'
    )
    assert numbered(OpenAIParser()).parse(legacy).calls == [ParsedCall("id0", "get_time", '{"tz": "CET"}')]


def test_a_commentary_preamble_to_no_one_is_content_and_messages_join_with_a_newline() -> None:
    text = "<|channel|>commentary<|message|>Checking.<|end|>" + CALL + FINAL
    output = numbered(OpenAIParser()).parse(text)
    assert output.content == "Checking.\nIt is 18 C in Paris."
    assert [c.name for c in output.calls] == ["get_weather"]


def test_text_without_harmony_markers_is_the_answer() -> None:
    assert OpenAIParser().parse("plain words") == ParsedOutput("plain words", [])


def test_a_stream_without_reasoning_kept_sends_only_the_content() -> None:
    reader = OutputReader(get_reasoning_parser("openai_gptoss"), None, keep_reasoning=False)
    events = reader.feed(ANALYSIS + FINAL, final=True)
    assert events == [ContentDelta("It is 18 C in Paris.")]
