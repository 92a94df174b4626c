"""Function calls read out of JSON text that may still be growing (a stream).

Ownership: the one JSON scanner of tool calling. ``scan_call`` reads one call object
``{"name": ..., "<arguments key>": {...}}`` and ``scan_calls`` a JSON array of them, from text
that may end anywhere. What they return only ever grows as the text grows: the name once its
string is complete, and the arguments as the raw text of their value so far (every character
before the value's closing bracket belongs to it), so a stream can send the arguments in
pieces and the pieces add up to what a parse of the whole text gives. Text that cannot be a
call raises ``ValueError``.
"""

from __future__ import annotations

import json
from typing import NamedTuple

_WS = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}


class PartialCall(NamedTuple):
    """A call as far as the text goes. ``name`` is None until its string is complete;
    ``arguments`` is the raw JSON text of the arguments value so far ("{}" once a complete
    call had none); ``complete``: the call's object closed."""

    name: str | None
    arguments: str
    complete: bool


class Scan(NamedTuple):
    calls: list[PartialCall]
    end: int | None  # index after the scanned JSON, None while it is unfinished


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i]`` is '"': the index after the closing quote, None if the text ends first."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]``, None if the text ends first
    (a bare scalar counts as unfinished until a delimiter follows it)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in _CLOSERS:
        stack = [_CLOSERS[c]]
        i += 1
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in _CLOSERS:
                stack.append(_CLOSERS[c])
            elif c in "}]":
                if c != stack.pop():
                    raise ValueError(f"mismatched {c!r} at {i}")
                if not stack:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",]}":
        j += 1
    if j == i:
        raise ValueError(f"no JSON value at {i}")
    return j if j < len(text) else None


def scan_call(text: str, i: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call object starting at ``text[i]`` (which must be '{') and the index after it."""
    if text[i] != "{":
        raise ValueError(f"a call is a JSON object; got {text[i]!r}")
    name: str | None = None
    arguments: str | None = None
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return PartialCall(name, arguments or "", False), None
        if text[i] == "}":
            if name is None:
                raise ValueError("a call needs a name")
            return PartialCall(name, "{}" if arguments is None else arguments, True), i + 1
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return PartialCall(name, arguments or "", False), None
        if text[i] != '"':
            raise ValueError(f"expected a key at {i}")
        key_end = _string_end(text, i)
        if key_end is None:
            return PartialCall(name, arguments or "", False), None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return PartialCall(name, arguments or "", False), None
        if text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        start = i
        end = value_end(text, i)
        if key == "name":
            if end is None:
                return PartialCall(name, arguments or "", False), None
            value = json.loads(text[start:end])
            if not isinstance(value, str):
                raise ValueError("a call's name is a string")
            name = value
        elif key in argument_keys:
            if end is None:
                # An object's text so far is all its own; a scalar waits until it ends.
                partial = text[start:] if text[start : start + 1] == "{" else ""
                return PartialCall(name, partial, False), None
            arguments = text[start:end]
            if not arguments.startswith("{"):
                raise ValueError("a call's arguments are a JSON object")
        elif end is None:
            return PartialCall(name, arguments or "", False), None
        i = end


def scan_calls(text: str, i: int, argument_keys: tuple[str, ...]) -> Scan:
    """The JSON array of calls starting at ``text[i]`` (which must be '[')."""
    if text[i] != "[":
        raise ValueError(f"calls are a JSON array; got {text[i]!r}")
    calls: list[PartialCall] = []
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return Scan(calls, None)
        if text[i] == "]":
            return Scan(calls, i + 1)
        if text[i] == "," and calls:
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return Scan(calls, None)
        call, end = scan_call(text, i, argument_keys)
        calls.append(call)
        if end is None:
            return Scan(calls, None)
        i = end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (a stream
    holds them until the next token says whether they are)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
