"""Incremental detokenization and stop-string detection for one sequence.

Decoding the whole output every step costs O(n^2) over a long generation, so only a small window
is decoded per token (the way vLLM and TGI do it): ``prefix_offset..read_offset`` is text already
emitted, ``read_offset..`` is new. A window ending in an incomplete UTF-8 character decodes to
U+FFFD and is held back until the next token completes it.

Fast path: for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 and the embedded byte tokenizer)
``tokenizer.decode(ids)`` is the lossy UTF-8 decoding of the concatenated bytes of the tokens. A
``ByteTable`` holds those bytes per token id, built and checked against ``tokenizer.decode`` once
per tokenizer; the windows are then decoded with ``bytes.decode`` (well under a microsecond)
instead of two trips through transformers (~15 µs per token). The window logic is the same on
both paths, so the text is the same; tokenizers the table cannot reproduce exactly (SentencePiece
decoders that strip a leading space, tokenization-space cleanup) take the slow path.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer is only called, never constructed, here
    from transformers import PreTrainedTokenizerBase

# Tokens of context decoded before the new ones so that spacing/merges come out right.
_CONTEXT_TOKENS = 5
# Random multi-token sequences checked against tokenizer.decode when a byte table is built.
_CHECK_SEQUENCES = 64


class ByteTable:
    """Bytes of every token id as ``decode(..., skip_special_tokens=True)`` sees them (``b""``
    for special and unknown ids), and the text of each id whose bytes are non-empty ASCII
    (``ascii_text``, None for the others). Immutable once built; shared by every detokenizer of
    one tokenizer."""

    __slots__ = ("ascii_text", "token_bytes")

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.ascii_text: list[str | None] = [
            b.decode("ascii") if b and b.isascii() else None for b in token_bytes
        ]

    def bytes_of(self, token_id: int) -> bytes:
        table = self.token_bytes
        return table[token_id] if 0 <= token_id < len(table) else b""

    def join(self, ids: Sequence[int]) -> bytes:
        return b"".join([self.bytes_of(i) for i in ids])

    def decode(self, ids: Sequence[int]) -> str:
        return self.join(ids).decode("utf-8", "replace")


_TABLES: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, ByteTable | None] = (
    weakref.WeakKeyDictionary()
)


def byte_table(tokenizer: PreTrainedTokenizerBase) -> ByteTable | None:
    """The tokenizer's ``ByteTable``, or None when decoding is not plain byte concatenation."""
    try:
        return _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # a tokenizer that cannot be a weak key: no table (the slow path)
        return None
    table = _build_byte_table(tokenizer)
    _TABLES[tokenizer] = table
    return table


def _build_byte_table(tokenizer: PreTrainedTokenizerBase) -> ByteTable | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    char_to_byte = _gpt2_char_to_byte()
    special = set(tokenizer.all_special_ids)
    size = max(backend.get_vocab_size(with_added_tokens=True), len(tokenizer))
    token_bytes: list[bytes] = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None or i in special:
            token_bytes.append(b"")
        elif all(c in char_to_byte for c in token):
            token_bytes.append(bytes(char_to_byte[c] for c in token))
        else:  # the decoder passes a token with characters outside the alphabet through as UTF-8
            token_bytes.append(token.encode())
    table = ByteTable(token_bytes)
    # Trust only what matches the tokenizer: every id alone, then random mixtures (including
    # ids past the vocabulary, which decode to nothing).
    singles = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    if any(text != table.decode([i]) for i, text in enumerate(singles)):
        return None
    rng = random.Random(0)
    for _ in range(_CHECK_SEQUENCES):
        ids = [rng.randrange(size + 8) for _ in range(rng.randrange(1, 12))]
        if tokenizer.decode(ids, skip_special_tokens=True) != table.decode(ids):
            return None
    return table


def _gpt2_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for U+0100.. in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + k): b for k, b in enumerate(others)})
    return table


class Detokenizer:
    """One sequence's text so far (``text``) and the rule for what a new token makes final.

    Two paths with one rule, decode(prefix window + new tokens) minus decode(prefix window),
    held back while it ends in an incomplete character: with a ``ByteTable`` the windows are
    kept as bytes (``_prefix_bytes``, ``_pending``); without one as token ids with offsets."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.table = byte_table(tokenizer)
        self.text = ""
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # Slow path state: token ids of the windows (prefix_offset..read_offset is emitted).
        self.token_ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        # Fast path state: the bytes of the prefix window and of the tokens not yet made final.
        self._prefix_bytes = b""
        self._pending = b""
        if self.table is not None:
            self._prefix_bytes = self.table.join(context)

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text if isinstance(text, str) else "".join(text)

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text it made final (possibly "")."""
        table = self.table
        if table is not None:  # once per sequence per step
            texts = table.ascii_text
            # A logits column past the tokenizer's vocabulary decodes to nothing (as bytes_of).
            in_table = 0 <= token_id < len(texts)
            if in_table and not self._pending and (new := texts[token_id]) is not None:
                # The common case, without decoding the window: ASCII bytes never complete or
                # extend a character, so decode(prefix + piece) == decode(prefix) + piece (an
                # incomplete character at the prefix's end is replaced alike either way).
                self._prefix_bytes = table.token_bytes[token_id]
                self.text += new
                return new
            piece = table.bytes_of(token_id)
            if not piece:  # a special token (or past the vocabulary): no text, no state change
                return ""
            pending = self._pending + piece
            window = self._prefix_bytes
            full = (window + pending).decode("utf-8", "replace")
            prefix_len = len(window) if window.isascii() else len(window.decode("utf-8", "replace"))
            if len(full) <= prefix_len or full.endswith("\ufffd"):
                self._pending = pending
                return ""
            new = full[prefix_len:]
            self._prefix_bytes, self._pending = pending, b""
            self.text += new
            return new
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
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
