"""Text helpers of the generated reference pages: a help string as a sentence, a table cell."""

from __future__ import annotations


def sentence(text: str) -> str:
    text = text.replace("|", "\\|").strip()
    return text + "." if text and not text.endswith(".") else text


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
