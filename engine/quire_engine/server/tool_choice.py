"""A chat request's ``tools`` and ``tool_choice``, checked, as a ``ToolPlan``.

Ownership: the one place that decides how a request's tool calls come about. ``none``: the
tools are shown to the template, nothing is parsed. A named function: the grammar makes the
output that function's arguments (a JSON schema of its ``parameters``). ``required``: the
grammar makes the output a JSON array of one or more ``{"name", "parameters"}`` objects, each
valid for its function (at most one with ``parallel_tool_calls: false``). ``auto``: the model
writes what it likes and the server's ``--tool-call-parser`` reads calls out of it, which needs
``--enable-auto-tool-choice`` (as vLLM); it is the default when ``tools`` are given.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from quire_engine.core import knobs
from quire_engine.core.constraint import ConstraintKind, OutputConstraint
from quire_engine.core.knobs import knob
from quire_engine.server.protocol import Json, OpenAIError
from quire_engine.server.tool_parsers import (
    NamedParser,
    RequiredParser,
    ToolParser,
    ToolParserName,
    auto_parser,
)

_NO_PARAMETERS: Json = {"type": "object", "properties": {}}


class ToolMode(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto: bool = knob(
        False,
        "allow tool_choice 'auto' (the default when a request has tools): the model's calls "
        "are read out of its text by --tool-call-parser",
        name="enable_auto_tool_choice",
    )
    parser: ToolParserName | None = knob(
        None,
        "the format of the model's tool calls, for tool_choice 'auto'",
        name="tool_call_parser",
    )

    def __post_init__(self) -> None:
        knobs.check(self)
        if self.enable_auto and self.parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")


class ToolPlan(NamedTuple):
    mode: ToolMode
    constraint: OutputConstraint | None  # named and required
    parser: Callable[[], ToolParser] | None  # makes one per choice; None for none
    max_calls: int | None


def plan(
    tools: list[Json] | None,
    tool_choice: str | Json | None,
    parallel_tool_calls: bool | None,
    settings: ToolSettings,
) -> ToolPlan:
    functions = _functions(tools or [])
    max_calls = 1 if parallel_tool_calls is False else None
    mode, name = _mode(tool_choice, functions)
    if mode is ToolMode.NONE:
        return ToolPlan(mode, None, None, None)
    if mode is ToolMode.AUTO:
        parser_name = settings.parser
        if not settings.enable_auto or parser_name is None:
            raise OpenAIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return ToolPlan(mode, None, lambda: auto_parser(parser_name), max_calls)
    if mode is ToolMode.NAMED:
        assert name is not None
        schema = json.dumps(functions[name])
        return ToolPlan(mode, _constraint(schema), lambda: NamedParser(name), max_calls)
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for fn, params in functions.items()
    ]
    array: Json = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        array["maxItems"] = max_calls
    return ToolPlan(mode, _constraint(json.dumps(array)), RequiredParser, max_calls)


def _constraint(schema: str) -> OutputConstraint:
    try:
        return OutputConstraint(ConstraintKind.JSON, schema)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="tools") from exc


def _functions(tools: list[Json]) -> dict[str, Json]:
    """Function name -> its parameters schema, for OpenAI's ``{"type": "function",
    "function": {"name", "description", "parameters"}}`` tools."""
    functions: dict[str, Json] = {}
    for k, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise OpenAIError(
                400,
                f"tools[{k}] must be {{'type': 'function', 'function': {{...}}}}",
                param="tools",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, f"tools[{k}].function.name must be a string", param="tools")
        if name in functions:
            raise OpenAIError(400, f"tools name {name!r:.60} twice", param="tools")
        params: Any = fn.get("parameters")
        if params is None:
            params = _NO_PARAMETERS
        if not isinstance(params, dict):
            raise OpenAIError(
                400, f"tools[{k}].function.parameters must be a JSON schema object", param="tools"
            )
        functions[name] = params
    return functions


def _mode(
    tool_choice: str | Json | None, functions: dict[str, Json]
) -> tuple[ToolMode, str | None]:
    if tool_choice is None:
        return (ToolMode.AUTO if functions else ToolMode.NONE), None
    if isinstance(tool_choice, str):
        modes = {m.value: m for m in (ToolMode.NONE, ToolMode.AUTO, ToolMode.REQUIRED)}
        mode = modes.get(tool_choice)
        if mode is None:
            raise OpenAIError(
                400,
                f"tool_choice must be none, auto, required or a function; got {tool_choice!r:.40}",
                param="tool_choice",
            )
        if mode is not ToolMode.NONE and not functions:
            raise OpenAIError(400, f"tool_choice {mode} needs tools", param="tool_choice")
        return mode, None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(
            400,
            "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in functions:
        raise OpenAIError(
            400, f"tool_choice names {name!r:.60}, which is not in tools", param="tool_choice"
        )
    return ToolMode.NAMED, name
