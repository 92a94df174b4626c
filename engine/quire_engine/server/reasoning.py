"""``--reasoning-parser``: a model's thinking (``<think>...</think>``) apart from its answer.

Ownership: ``split`` turns the text generated so far into ``Reasoning``: the reasoning and the
content as far as each is sure (while the text may grow, a tag that may be arriving at its end
is held back), so a stream sends differences. vLLM's names:

- ``qwen3``: reasoning when the output opens with ``<think>``, up to ``</think>`` (or the end
  of an output cut short); an output without ``<think>`` is all content.
- ``deepseek_r1``: the template opens the thinking, so everything up to ``</think>`` is
  reasoning (an opening ``<think>`` is dropped); an output that never closes it is all reasoning.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from quire_engine.server.json_calls import held_back

OPEN = "<think>"
CLOSE = "</think>"


class ReasoningParserName(enum.StrEnum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


class Reasoning(NamedTuple):
    reasoning: str
    content: str


def split(parser: ReasoningParserName, text: str, final: bool) -> Reasoning:
    body = text.lstrip()
    opened = body.startswith(OPEN)
    if not opened and not final and body and OPEN.startswith(body):
        return Reasoning("", "")  # "<thi": the tag may be arriving
    if opened:
        body = body[len(OPEN) :]
    elif parser is ReasoningParserName.QWEN3:
        return Reasoning("", text if final else text[: len(text) - held_back(text, OPEN)])
    else:
        body = text
    end = body.find(CLOSE)
    if end >= 0:
        return Reasoning(body[:end], body[end + len(CLOSE) :])
    return Reasoning(body if final else body[: len(body) - held_back(body, CLOSE)], "")
