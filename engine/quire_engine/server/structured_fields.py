"""``response_format`` (OpenAI) and ``structured_outputs`` (vLLM) to one ``OutputConstraint``.

``response_format``: ``text`` (nothing), ``json_object`` (any JSON object) or ``json_schema``
(``{"json_schema": {"name", "schema", "strict"}}``; the schema is always enforced, as with
``strict``). ``structured_outputs``: exactly one of ``json`` (a schema, as an object or its
text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object: true``;
its other vLLM options are refused when set. Whether the constraint compiles is checked later,
by the engine's grammar cache (a 400 with the compiler's message).
"""

from __future__ import annotations

import json
from typing import Any

from quire_engine.core.constraint import ConstraintKind, OutputConstraint

Json = dict[str, Any]
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's further structured_outputs options, and the values that ask for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False, None),
    "disable_any_whitespace": (False, None),
    "disable_additional_properties": (False, None),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
    "backend": (None, "xgrammar", "auto"),
}


class ConstraintError(ValueError):
    """A malformed constraint field; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def output_constraint(
    response_format: Json | None, structured_outputs: Json | None
) -> tuple[OutputConstraint, str] | None:
    from_format = _from_response_format(response_format) if response_format else None
    from_vllm = _from_structured_outputs(structured_outputs) if structured_outputs else None
    if from_format is not None and from_vllm is not None:
        raise ConstraintError(
            "give response_format or structured_outputs, not both", "structured_outputs"
        )
    if from_format is not None:
        return from_format, "response_format"
    if from_vllm is not None:
        return from_vllm, "structured_outputs"
    return None


def _from_response_format(fmt: Json) -> OutputConstraint | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError("response_format json_schema needs a json_schema object",
                                  "response_format")  # fmt: skip
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise ConstraintError("json_schema.schema must be a JSON schema object",
                                  "response_format")  # fmt: skip
        return _make(ConstraintKind.JSON, json.dumps(schema), "response_format")
    raise ConstraintError(
        f"response_format type must be text, json_object or json_schema; got {kind!r:.40}",
        "response_format",
    )


def _from_structured_outputs(params: Json) -> OutputConstraint | None:
    for name, value in params.items():
        if name in _KINDS:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is None or not any(value == v and type(value) is type(v) for v in neutral):
            raise ConstraintError(
                f"structured_outputs.{name} is not supported by this server", "structured_outputs"
            )
    given = [k for k in _KINDS if params.get(k) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(
            f"structured_outputs takes one of {', '.join(_KINDS)}; got {', '.join(given)}",
            "structured_outputs",
        )
    kind, value = given[0], params[given[0]]
    if kind == "json_object":
        return OutputConstraint(ConstraintKind.JSON_OBJECT)
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)
        return _make(ConstraintKind.JSON, text, "structured_outputs")
    if kind == "choice":
        if not isinstance(value, list):
            raise ConstraintError("structured_outputs.choice must be a list of strings",
                                  "structured_outputs")  # fmt: skip
        try:
            return OutputConstraint.choice(value)
        except ValueError as exc:
            raise ConstraintError(str(exc), "structured_outputs") from exc
    if not isinstance(value, str):
        raise ConstraintError(f"structured_outputs.{kind} must be a string", "structured_outputs")
    return _make(ConstraintKind(kind), value, "structured_outputs")


def _make(kind: ConstraintKind, spec: str, param: str) -> OutputConstraint:
    try:
        return OutputConstraint(kind, spec)
    except ValueError as exc:
        raise ConstraintError(str(exc), param) from exc
