"""Incremental detokenization and stop-string detection for one sequence.

Decoding the whole output every step costs O(n^2) over a long generation, so only a small window
is decoded per token (the way vLLM and TGI do it): ``prefix_offset..read_offset`` is text already
emitted, ``read_offset..`` is new. A window ending in an incomplete UTF-8 character decodes to
U+FFFD and is held back until the next token completes it.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens of context decoded before the new ones so that spacing/merges come out right.
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text if isinstance(text, str) else "".join(text)

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text it made final (possibly "")."""
        self.token_ids.append(token_id)
        decode = self._decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        full = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += new
        return new


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_len`` characters of ``text``.

    Returns (index where the stop string starts, the stop string). Only the tail is searched, with
    enough overlap for a stop string split across tokens."""
    if not stops or not new_len:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
