"""Tool-call and reasoning parsers on hand-made model outputs: whole texts, and the same texts
fed one character at a time as a stream (the deltas must add up to the whole text's message)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from quire_engine.server.choice_parser import ChoiceParser, OutputFormat
from quire_engine.server.json_calls import PartialCall, scan_call
from quire_engine.server.reasoning import ReasoningParserName, split
from quire_engine.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolParser,
)

WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a } and \\" inside"}'


def assemble(fmt: OutputFormat, text: str) -> dict[str, Any]:
    """Stream ``text`` one character at a time; the message the deltas add up to."""
    parser = ChoiceParser(fmt)
    out: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for end in range(1, len(text) + 1):
        delta = parser.delta(text[:end], end == len(text))
        out["content"] += delta.get("content", "")
        out["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            calls = out["tool_calls"]
            if call["index"] == len(calls):
                assert {"id", "type", "function"} <= set(call), call
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": ""})
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return out


def whole(fmt: OutputFormat, text: str) -> dict[str, Any]:
    message = ChoiceParser(fmt).message(text)
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]
    return {
        "content": message["content"] or "",
        "reasoning_content": message.get("reasoning_content") or "",
        "tool_calls": calls,
    }


def tools(parser: ToolParser, max_calls: int | None = None) -> OutputFormat:
    return OutputFormat(tools=lambda: parser, max_calls=max_calls)


CASES = [
    (
        HermesParser(),
        f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>'
        '\n<tool_call>{"arguments": {}, "name": "time"}</tool_call>',
        "Let me look.\n",
        [("weather", WEATHER), ("time", "{}")],
    ),
    (HermesParser(), "No tools <tool here", "No tools <tool here", []),
    (
        Llama3JsonParser(),
        f'<|python_tag|>{{"name": "weather", "parameters": {WEATHER}}}; {{"name": "t"}}',
        "",
        [("weather", WEATHER), ("t", "{}")],
    ),
    (Llama3JsonParser(), f' {{"name": "w", "arguments": {WEATHER}}}', "", [("w", WEATHER)]),
    (Llama3JsonParser(), "Just words {not a call}", "Just words {not a call}", []),
    (
        MistralParser(),
        f'Sure. [TOOL_CALLS] [{{"name": "weather", "arguments": {WEATHER}}}, {{"name": "t", '
        '"arguments": {"a": 1}}]',
        "Sure. ",
        [("weather", WEATHER), ("t", '{"a": 1}')],
    ),
    (MistralParser(), f'[{{"name": "w", "arguments": {WEATHER}}}]', "", [("w", WEATHER)]),
    (MistralParser(), "[1, 2] is a list", "[1, 2] is a list", []),
    (NamedParser("weather"), WEATHER, "", [("weather", WEATHER)]),
    (
        RequiredParser(),
        f'[{{"name": "weather", "parameters": {WEATHER}}}, {{"name": "t", "parameters": {{}}}}]',
        "",
        [("weather", WEATHER), ("t", "{}")],
    ),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_calls_whole_and_streamed(
    parser: ToolParser, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    expected = {
        "content": content,
        "reasoning_content": "",
        "tool_calls": [{"name": n, "arguments": a} for n, a in calls],
    }
    assert whole(tools(parser), text) == expected
    assert assemble(tools(parser), text) == expected
    for _, arguments in calls:
        json.loads(arguments)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}'
    fmt = tools(HermesParser(), max_calls=1)
    assert [c["name"] for c in whole(fmt, text + "</tool_call>")["tool_calls"]] == ["a"]
    assert [c["name"] for c in assemble(fmt, text)["tool_calls"]] == ["a"]


def test_a_broken_call_is_content() -> None:
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>'  # one brace short
    assert whole(tools(HermesParser()), text) == {
        "content": text,
        "reasoning_content": "",
        "tool_calls": [],
    }
    text = '<tool_call>{"name": "a", "arguments": {"x": 1} oops'
    message = ChoiceParser(tools(HermesParser())).message(text)
    assert message["content"] == text and "tool_calls" not in message


def test_partial_calls_only_grow() -> None:
    text = f'{{"name": "weather", "arguments": {WEATHER}}}'
    seen = PartialCall(None, "", False)
    for end in range(1, len(text) + 1):
        call, _ = scan_call(text[:end], 0, ("arguments",))
        assert call.arguments.startswith(seen.arguments)
        assert seen.name is None or call.name == seen.name
        seen = call
    assert seen == PartialCall("weather", WEATHER, True)


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nhmm, 2+2</think>\n\nIt is 4.", "\nhmm, 2+2", "\n\nIt is 4."),
        ("qwen3", "It is 4.", "", "It is 4."),
        ("qwen3", "<think>cut short", "cut short", ""),
        ("qwen3", "a < b <thin", "", "a < b <thin"),
        ("deepseek_r1", "hmm</think>It is 4.", "hmm", "It is 4."),
        ("deepseek_r1", "<think>hmm</think>It is 4.", "hmm", "It is 4."),
        ("deepseek_r1", "still thinking", "still thinking", ""),
    ],
)
def test_reasoning_whole_and_streamed(name: str, text: str, reasoning: str, content: str) -> None:
    parser = ReasoningParserName(name)
    assert split(parser, text, True) == (reasoning, content)
    fmt = OutputFormat(reasoning=parser)
    expected = {"content": content, "reasoning_content": reasoning, "tool_calls": []}
    assert whole(fmt, text) == expected
    assert assemble(fmt, text) == expected


def test_reasoning_then_tool_calls() -> None:
    text = '<think>weather needed</think>\n<tool_call>{"name": "w", "arguments": {"c": 1}}'
    fmt = OutputFormat(ReasoningParserName.QWEN3, tools=HermesParser)
    expected = {
        "content": "\n",
        "reasoning_content": "weather needed",
        "tool_calls": [{"name": "w", "arguments": '{"c": 1}'}],
    }
    assert assemble(fmt, text) == expected
    assert whole(fmt, text + "</tool_call>") == expected


def test_reasoning_left_out_when_not_included() -> None:
    fmt = OutputFormat(ReasoningParserName.QWEN3, include_reasoning=False)
    assert "reasoning_content" not in ChoiceParser(fmt).message("<think>x</think>y")
    assert assemble(fmt, "<think>x</think>y")["reasoning_content"] == ""
