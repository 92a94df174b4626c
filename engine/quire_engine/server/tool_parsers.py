"""Tool calls out of generated text: the formats of ``--tool-call-parser`` (vLLM's names) for
``tool_choice: auto``, and the grammar-made formats of a named or ``required`` tool choice.

Ownership: each parser turns the text generated so far (``final`` False while it may grow)
into ``ToolParse``: the content that is surely not part of a call, and the calls as far as
they go. The results grow with the text (a stream sends differences); a marker that may be
starting at the end of unfinished text is held back. Text that starts a call and then is not
one raises ``ValueError`` (the caller shows it as content). Formats:

- ``hermes`` (Hermes, Qwen): content, then ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks.
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.
  ``[TOOL_CALLS]`` is a special token in Mistral's tokenizers, and the server's text skips
  special tokens, so an output that starts with such an array counts as calls too.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple, Protocol

from quire_engine.server.json_calls import PartialCall, held_back, scan_call, scan_calls, skip_ws


class ToolParserName(enum.StrEnum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


class ToolParse(NamedTuple):
    content: str
    calls: list[PartialCall]


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> ToolParse: ...


def _content(text: str, marker: str, final: bool) -> str:
    return text if final else text[: len(text) - held_back(text, marker)]


class HermesParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _KEYS = ("arguments", "parameters")

    def parse(self, text: str, final: bool) -> ToolParse:
        start = text.find(self.OPEN)
        if start < 0:
            return ToolParse(_content(text, self.OPEN, final), [])
        calls: list[PartialCall] = []
        i = start
        while i >= 0:
            i = skip_ws(text, i + len(self.OPEN))
            if i >= len(text):
                break
            call, end = scan_call(text, i, self._KEYS)
            calls.append(call)
            if end is None:
                break
            close = skip_ws(text, end)
            if not self.CLOSE.startswith(text[close : close + len(self.CLOSE)]):
                raise ValueError(f"expected {self.CLOSE} after a call")
            i = text.find(self.OPEN, close)
        return ToolParse(text[:start], calls)


class Llama3JsonParser:
    TAG = "<|python_tag|>"
    _KEYS = ("parameters", "arguments")

    def parse(self, text: str, final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return ToolParse("", [])  # nothing yet, or the tag arriving
        if i >= len(text):
            return ToolParse("" if not final else text, [])
        if text[i] != "{":
            return ToolParse(text, [])
        calls: list[PartialCall] = []
        while i < len(text):
            call, end = scan_call(text, i, self._KEYS)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                raise ValueError("calls are separated by ';'")
        return ToolParse("", calls)


_BARE_ARRAY = re.compile(r'\s*\[\s*\{\s*"name"')
_BARE_START = '[{"name"'


class MistralParser:
    MARKER = "[TOOL_CALLS]"
    _KEYS = ("arguments", "parameters")

    def parse(self, text: str, final: bool) -> ToolParse:
        start = text.find(self.MARKER)
        if start >= 0:
            i = skip_ws(text, start + len(self.MARKER))
        elif _BARE_ARRAY.match(text):
            start = i = skip_ws(text, 0)
        elif not final and text.strip() and _BARE_START.startswith(re.sub(r"\s", "", text)):
            return ToolParse("", [])  # could still become a bare array of calls
        else:
            return ToolParse(_content(text, self.MARKER, final), [])
        if i >= len(text):
            return ToolParse(text[:start], [])
        return ToolParse(text[:start], scan_calls(text, i, self._KEYS).calls)


class NamedParser:
    """``tool_choice`` naming a function: the grammar makes the whole output its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ToolParse:
        return ToolParse("", [PartialCall(self.name, text.lstrip(), final)])


class RequiredParser:
    """``tool_choice: required``: the grammar makes the output a JSON array of
    ``{"name": ..., "parameters": {...}}``."""

    def parse(self, text: str, final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ToolParse("", [])
        return ToolParse("", scan_calls(text, i, ("parameters",)).calls)


def auto_parser(name: ToolParserName) -> ToolParser:
    parsers: dict[ToolParserName, type[ToolParser]] = {
        ToolParserName.HERMES: HermesParser,
        ToolParserName.LLAMA3_JSON: Llama3JsonParser,
        ToolParserName.MISTRAL: MistralParser,
    }
    return parsers[name]()
