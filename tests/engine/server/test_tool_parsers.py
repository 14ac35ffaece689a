"""Each tool-call parser, whole and streamed: the exact calls, and the exact events per text delta."""

from __future__ import annotations

import json
from itertools import count

import pytest

from kvfleet.engine.server.tool_parsers import PARSERS, get_parser
from kvfleet.engine.server.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCall,
    ParsedOutput,
    StreamEvent,
    ToolParser,
)
from kvfleet.engine.server.tool_parsers.forced import NamedParser, RequiredParser
from kvfleet.engine.server.tool_parsers.json_scan import scan_call, value_end


def numbered(parser: ToolParser) -> ToolParser:
    """The parser with ids id0, id1, ... (real ones are random)."""
    ids = count()
    parser.new_call_id = lambda: f"id{next(ids)}"  # type: ignore[method-assign]
    return parser


def streamed(parser: ToolParser, pieces: list[str]) -> list[list[StreamEvent]]:
    stream = numbered(parser).stream()
    return [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def test_the_parsers_are_registered_by_name() -> None:
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral", "openai", "qwen"]
    assert get_parser("qwen").name == "qwen"
    with pytest.raises(ValueError, match="unknown parser 'nope'; known: \\['hermes', 'llama3_json'"):
        get_parser("nope")


HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("name", ["hermes", "qwen"])
def test_hermes_reads_content_then_each_tagged_call(name: str) -> None:
    second = '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert numbered(get_parser(name)).parse(HERMES + second) == ParsedOutput(
        "Let me check.\n",
        [ParsedCall("id0", "get_weather", '{"city": "Paris"}'), ParsedCall("id1", "get_time", "{}")],
    )


def test_hermes_text_without_a_whole_call_is_all_content() -> None:
    parser = get_parser("hermes")
    assert parser.parse("Just text.") == ParsedOutput("Just text.", [])
    cut = HERMES[:-30]
    assert parser.parse(cut) == ParsedOutput(cut, [])  # the call never closed: as vLLM, the text is content
    assert parser.parse('<tool_call>\n{"name": "f", "arguments": {bad}}</tool_call>').calls == []


def test_hermes_streams_content_holds_a_maybe_tag_then_sends_id_and_name_then_fragments() -> None:
    pieces = ["Let me", " check.\n<tool", '_call>\n{"name": "get_', 'weather", "argu', 'ments": {"city', '": "Paris"}', "}\n</tool_call>"]  # fmt: skip
    assert streamed(get_parser("hermes"), pieces) == [
        [ContentDelta("Let me")],
        [ContentDelta(" check.\n")],  # "<tool" may open a tag: held back
        [],  # the name has not closed
        [CallStart(0, "id0", "get_weather")],
        [ArgumentsDelta(0, '{"city')],
        [ArgumentsDelta(0, '": "Paris"}')],
        [],
    ]


def test_hermes_releases_held_back_text_that_was_no_tag_after_all() -> None:
    assert streamed(get_parser("hermes"), ["a <to", "y> b", " <tool"]) == [
        [ContentDelta("a ")],
        [ContentDelta("<toy> b")],
        [ContentDelta(" <tool")],  # the end: what was held back is content
    ]


def test_llama3_json_reads_semicolon_separated_calls_with_parameters() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [2, "}"]}}'
    assert numbered(get_parser("llama3_json")).parse(text) == ParsedOutput(
        None, [ParsedCall("id0", "a", '{"x": 1}'), ParsedCall("id1", "b", '{"y": [2, "}"]}')]
    )
    assert get_parser("llama3_json").parse("The answer is {x}.") == ParsedOutput("The answer is {x}.", [])


def test_llama3_json_streams_text_as_content_and_calls_as_calls() -> None:
    assert streamed(get_parser("llama3_json"), ["Hello", " there"]) == [
        [ContentDelta("Hello")],
        [ContentDelta(" there")],
    ]
    assert streamed(
        get_parser("llama3_json"), ["<|python", '_tag|>{"name": "a", "parameters": {"x"', ": 1}}"]
    ) == [
        [],
        [CallStart(0, "id0", "a"), ArgumentsDelta(0, '{"x"')],
        [ArgumentsDelta(0, ": 1}")],
    ]


def test_llama3_json_unnamed_json_ends_as_content() -> None:
    assert streamed(get_parser("llama3_json"), ['{"x": ', "1}"]) == [[], [ContentDelta('{"x": 1}')]]


MISTRAL = 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]'


def test_mistral_reads_the_array_after_the_token_with_nine_character_ids() -> None:
    parser = get_parser("mistral")
    out = parser.parse(MISTRAL)
    assert (out.content, [(c.name, c.arguments) for c in out.calls]) == (
        "Sure. ",
        [("a", '{"q": "x"}'), ("b", "{}")],
    )
    assert [(len(c.id), c.id.isalnum()) for c in out.calls] == [(9, True), (9, True)]
    assert parser.skip_special_tokens is False  # [TOOL_CALLS] is a special token: kept in the text


def test_mistral_streams_each_call_of_the_array() -> None:
    pieces = [
        "Sure. [TOOL_",
        'CALLS] [{"name": "a", "arguments": {"q"',
        ': "x"}}, {"name": "b", "arguments": {}}]',
    ]
    assert streamed(get_parser("mistral"), pieces) == [
        [ContentDelta("Sure. ")],
        [CallStart(0, "id0", "a"), ArgumentsDelta(0, '{"q"')],
        [ArgumentsDelta(0, ': "x"}'), CallStart(1, "id1", "b"), ArgumentsDelta(1, "{}")],
    ]


def test_required_output_is_an_array_of_name_and_parameters() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert numbered(RequiredParser()).parse(text) == ParsedOutput(
        None, [ParsedCall("id0", "a", '{"x": 1}'), ParsedCall("id1", "b", "{}")]
    )
    assert streamed(
        RequiredParser(), ['[{"name"', ': "a", "parameters": {"x"', ": 1}}, {", '"name": "b"}]']
    ) == [
        [],
        [],  # a required call goes out once its object has closed: a cut cannot take it back
        [CallStart(0, "id0", "a"), ArgumentsDelta(0, '{"x": 1}')],
        [CallStart(1, "id1", "b"), ArgumentsDelta(1, "{}")],
    ]


REQUIRED_CUT = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}, {"name": "a", "para'


@pytest.mark.parametrize("end", [len(REQUIRED_CUT), REQUIRED_CUT.index(', {"name": "a"') + 2])
def test_a_required_array_cut_short_keeps_every_call_that_closed_before_the_cut(end: int) -> None:
    cut = REQUIRED_CUT[:end]
    both = [ParsedCall("id0", "a", '{"x": 1}'), ParsedCall("id1", "b", "{}")]
    assert numbered(RequiredParser()).parse(cut) == ParsedOutput(None, both)
    events = [e for batch in streamed(RequiredParser(), [cut[:30], cut[30:60], cut[60:]]) for e in batch]
    assert events == [CallStart(0, "id0", "a"), ArgumentsDelta(0, '{"x": 1}'), CallStart(1, "id1", "b"),
                      ArgumentsDelta(1, "{}")]  # fmt: skip


def test_a_required_array_cut_inside_its_first_call_has_no_call_and_is_content() -> None:
    cut = '[{"name": "a", "parameters": {"x"'
    assert RequiredParser().parse(cut) == ParsedOutput(cut, [])
    assert streamed(RequiredParser(), [cut]) == [[]]


def test_a_named_choice_sends_its_name_at_once_and_every_character_as_arguments() -> None:
    assert streamed(NamedParser("get_weather"), ['{"city"', ': "Paris"}']) == [
        [CallStart(0, "id0", "get_weather"), ArgumentsDelta(0, '{"city"')],
        [ArgumentsDelta(0, ': "Paris"}')],
    ]
    assert numbered(NamedParser("f")).parse('{"a": 1}') == ParsedOutput(
        None, [ParsedCall("id0", "f", '{"a": 1}')]
    )
    assert NamedParser("f").parse('{"a": ') == ParsedOutput('{"a": ', [])  # cut short: not a call


@pytest.mark.parametrize("cut", range(1, len(HERMES)))
def test_any_two_piece_cut_streams_what_the_whole_parse_reads(cut: int) -> None:
    events = [e for batch in streamed(get_parser("hermes"), [HERMES[:cut], HERMES[cut:]]) for e in batch]
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    arguments = "".join(e.text for e in events if isinstance(e, ArgumentsDelta))
    starts = [e for e in events if isinstance(e, CallStart)]
    assert (content, [s.name for s in starts], json.loads(arguments)) == (
        "Let me check.\n",
        ["get_weather"],
        {"city": "Paris"},
    )


def test_the_scanner_finds_value_ends_past_brackets_inside_strings() -> None:
    text = '{"a": "}]\\"", "b": [1, {"c": 2}]} tail'
    assert value_end(text, 0) == len(text) - len(" tail")
    assert value_end(text[:20], 0) is None
    assert scan_call('{"arguments": {"z": 0}, "name": "late"}', 0).name == "late"
