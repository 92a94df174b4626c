"""Token ids as logprobs show them: a key per token that never loses information, and its bytes.

Ownership: one ``TokenText`` per endpoint renderer, on the event loop (memoized per id: the same
few thousand ids recur). A token's text is ``decode([id])`` when that is complete UTF-8. A token
that is only part of a character (byte-level and byte-fallback tokenizers split multi-byte
characters) would decode to U+FFFD, and several such tokens would share that key; those are
spelled ``bytes:\\xe6\\x97`` instead (OpenAI's spelling), so every entry of ``top_logprobs`` keeps
its own key. ``bytes`` are the token's raw bytes, not the bytes of its replacement character.
An id with no text at all (past the tokenizer's vocabulary) is ``token_id:<id>``, vLLM's
spelling, which ``return_tokens_as_token_ids`` uses for every key.
"""

from __future__ import annotations

import re
from typing import Any

from quire_engine.core.detokenizer import byte_table

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"


class TokenText:
    """``key(id)``: the token's unique logprob key; ``raw(id)``: its bytes (a special token's
    text); ``shown(id)``: its bytes in text without special tokens."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_token_ids
        self._table = byte_table(tokenizer)
        self._keys: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def __call__(self, token_id: int) -> str:
        return self.key(token_id)

    def key(self, token_id: int) -> str:
        key = self._keys.get(token_id)
        if key is None:
            if self._as_ids:
                key = f"token_id:{token_id}"
            else:
                text = str(self._tokenizer.decode([token_id]))
                if not text:  # an id with no text (past the tokenizer's vocabulary)
                    key = f"token_id:{token_id}"
                elif REPLACEMENT in text and REPLACEMENT not in self.raw(token_id).decode(
                    "utf-8", "ignore"
                ):
                    key = "bytes:" + "".join(f"\\x{b:02x}" for b in self.raw(token_id))
                else:
                    key = text
            self._keys[token_id] = key
        return key

    def raw(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._table.bytes_of(token_id) if self._table is not None else b""
            if not raw:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
                match = _BYTE_FALLBACK.fullmatch(piece) if isinstance(piece, str) else None
                if match is not None:
                    raw = bytes([int(match.group(1), 16)])
                else:
                    raw = str(self._tokenizer.decode([token_id])).encode()
            self._bytes[token_id] = raw
        return raw

    def shown(self, token_id: int) -> bytes:
        """The token's bytes in text decoded without special tokens (what offsets count)."""
        if token_id in self._special:
            return b""
        return self.raw(token_id)

    def ranked(
        self, alternatives: dict[int, float], limit: int | None = None
    ) -> list[tuple[str, int, float]]:
        """``(key, id, logprob)`` best first; ids whose keys collide (rare: two ids of one text)
        are told apart by ``token_id:<id>``, so no entry overwrites another."""
        out: list[tuple[str, int, float]] = []
        seen: set[str] = set()
        for token_id, lp in sorted(alternatives.items(), key=lambda kv: -kv[1])[:limit]:
            key = self.key(token_id)
            if key in seen:
                key = f"token_id:{token_id}"
            seen.add(key)
            out.append((key, token_id, lp))
        return out
