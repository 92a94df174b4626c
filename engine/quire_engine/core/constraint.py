"""What a request's output must match (structured outputs): plain data, compiled elsewhere.

An ``OutputConstraint`` is its kind and its text (a JSON schema, a regex, a grammar, or the JSON
list of choices). It is hashable, so compiled grammars are cached by it; ``structured/`` compiles
it for the model's tokenizer and owns the matchers. The core only carries it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema or grammar larger than this is refused


class ConstraintKind(enum.StrEnum):
    """vLLM's ``structured_outputs`` keys (``json_object`` is ``response_format``'s)."""

    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # one of a list of strings
    GRAMMAR = "grammar"  # EBNF (xgrammar's GBNF dialect)


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    kind: ConstraintKind
    spec: str = ""  # schema JSON, regex, grammar, or the JSON list of choices

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise ValueError(f"structured output kind must be a ConstraintKind; got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"structured output spec must be a string of at most {MAX_CONSTRAINT_CHARS} "
                "characters"
            )
        if self.kind is not ConstraintKind.JSON_OBJECT and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")

    @classmethod
    def choice(cls, options: list[str]) -> OutputConstraint:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return cls(ConstraintKind.CHOICE, json.dumps(options))

    @property
    def choices(self) -> list[str]:
        options: list[str] = json.loads(self.spec)
        return options
