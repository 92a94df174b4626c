"""A chat choice's text read as OpenAI's message: reasoning, content and tool calls.

Ownership: one ``ChoiceParser`` per chat choice, made by the chat renderer when the request or
the server asks for parsing (tools, a reasoning parser). ``message`` reads a finished text;
``delta`` reads the text generated so far and returns only what is new since its last call
(the stream's delta fields). Reasoning is split off first (``reasoning``), then the tool parser
reads the content (``tool_parsers``). A finished call has an id (``chatcmpl-tool-<hex>``, as
vLLM's), ``type`` "function", and its arguments as JSON text; a stream's first delta of a call
carries index, id, type and name, later ones more of its arguments.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from quire_engine.server.json_calls import PartialCall
from quire_engine.server.protocol import Json
from quire_engine.server.reasoning import ReasoningParserName, split
from quire_engine.server.tool_parsers import ToolParse, ToolParser


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """How a request's chat outputs are read. ``tools`` makes a fresh tool parser (None: no
    tool calls are read); ``max_calls`` 1 for ``parallel_tool_calls: false``. ``forced``: a
    named or required tool choice, whose calls are reported as they are even when cut short
    (a stream has sent them already); an ``auto`` output whose calls do not all parse is
    content."""

    reasoning: ReasoningParserName | None = None
    include_reasoning: bool = True
    tools: Callable[[], ToolParser] | None = None
    max_calls: int | None = None
    forced: bool = False  # the grammar writes the calls: a cut-short call is still a call

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _valid(call: PartialCall) -> bool:
    if not call.complete or call.name is None:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments: int  # characters of the arguments sent


@dataclass(slots=True)
class ChoiceParser:
    fmt: OutputFormat
    _parser: ToolParser | None = None
    _reasoning: int = 0  # characters sent of each part
    _content: int = 0
    _calls: list[_SentCall] = field(default_factory=list)
    _broken: bool = False  # the text stopped being a call: the rest is content

    def __post_init__(self) -> None:
        self._parser = self.fmt.tools() if self.fmt.tools is not None else None

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.fmt.reasoning is None:
            return "", text
        reasoning, content = split(self.fmt.reasoning, text, final)
        return reasoning, content

    def message(self, text: str) -> Json:
        """The ``message`` of a finished choice (without ``role``)."""
        reasoning, content = self._split(text, True)
        calls: list[PartialCall] = []
        if self._parser is not None:
            try:
                parse = self._parser.parse(content, True)
            except ValueError:
                parse = ToolParse(content, [])
            if self.fmt.forced:
                content, calls = parse.content, [c for c in parse.calls if c.name is not None]
            elif parse.calls and all(_valid(c) for c in parse.calls):
                content, calls = parse.content, parse.calls
            calls = calls[: self.fmt.max_calls]
        message: Json = {"content": content if content or not calls else None}
        if self.fmt.reasoning is not None and self.fmt.include_reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            self._calls = [_SentCall(call_id(), len(c.arguments)) for c in calls]
            message["tool_calls"] = [
                _call_json(sent.id, c.name or "", c.arguments)
                for sent, c in zip(self._calls, calls, strict=True)
            ]
        return message

    def delta(self, text: str, final: bool) -> Json:
        """What is new in ``text`` (the whole text so far) since the last call: any of
        ``reasoning_content``, ``content`` and ``tool_calls``."""
        reasoning, content = self._split(text, final)
        delta: Json = {}
        if len(reasoning) > self._reasoning and self.fmt.include_reasoning:
            delta["reasoning_content"] = reasoning[self._reasoning :]
        self._reasoning = max(self._reasoning, len(reasoning))
        parse = ToolParse(content, [])
        if self._parser is not None and not self._broken:
            try:
                parse = self._parser.parse(content, final)
            except ValueError:
                self._broken = True
        if len(parse.content) > self._content:
            delta["content"] = parse.content[self._content :]
            self._content = len(parse.content)
        calls = self._call_deltas(parse.calls)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_deltas(self, calls: list[PartialCall]) -> list[Json]:
        out: list[Json] = []
        for k, call in enumerate(calls[: self.fmt.max_calls]):
            if call.name is None:
                break  # calls are sent in order, each once its name is known
            if k == len(self._calls):
                self._calls.append(_SentCall(call_id(), len(call.arguments)))
                out.append({"index": k, **_call_json(self._calls[k].id, call.name, call.arguments)})
                continue
            sent = self._calls[k]
            if len(call.arguments) > sent.arguments:
                out.append(
                    {"index": k, "function": {"arguments": call.arguments[sent.arguments :]}}
                )
                sent.arguments = len(call.arguments)
        return out


def _call_json(id: str, name: str, arguments: str) -> Json:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}
