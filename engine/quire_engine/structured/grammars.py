"""Compiled grammars for one tokenizer, cached by constraint.

Ownership: one ``GrammarCache`` per engine, shared by the engine thread (``get`` at
``add_request``, normally a cache hit) and the server's compile thread (``compile`` before a
request is submitted). An LRU of compiled grammars under one lock; xgrammar's compiler is
itself thread-safe. Invalid constraints raise ``ValueError`` carrying the compiler's message.
Compile times are kept (``compile_seconds``) for ``quire-engine bench``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import xgrammar as xgr

from quire_engine.core.constraint import ConstraintKind, OutputConstraint

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# xgrammar's character class of strings with minLength/maxLength, and the strict-JSON one.
_LOOSE_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\]"
CACHE_ENTRIES = 512
# Whitespace xgrammar allows between JSON tokens: any, up to this many characters in a row
# (a model that loops on spaces or newlines cannot run a document past max_tokens with it).
MAX_JSON_WHITESPACE = 16


class GrammarCache:
    """``compile(constraint)``: the compiled grammar (cached); ``ValueError`` when invalid."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._cache: OrderedDict[OutputConstraint, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []  # of each compile that missed the cache

    def cached(self, constraint: OutputConstraint) -> bool:
        with self._lock:
            return constraint in self._cache

    def compile(self, constraint: OutputConstraint) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        start = time.perf_counter()
        try:
            compiled = self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar's messages name the problem and its position; keep the first line.
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            message = _SOURCE_PREFIX.sub("", message)  # "[time] file.cc:94: " tells users nothing
            raise ValueError(f"invalid {constraint.kind}: {message}") from exc
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - start)
            self._cache[constraint] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: OutputConstraint) -> xgr.CompiledGrammar:
        kind = c.kind
        if kind is ConstraintKind.JSON_OBJECT:
            return self._compile_schema('{"type": "object"}')
        if kind is ConstraintKind.JSON:
            json.loads(c.spec)  # a JSON error names line and column
            return self._compile_schema(c.spec)
        if kind is ConstraintKind.REGEX:
            return self._compiler.compile_regex(c.spec)
        if kind is ConstraintKind.CHOICE:
            # One literal per choice; JSON string escapes are valid EBNF string escapes.
            alternatives = " | ".join(json.dumps(option) for option in c.choices)
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        return self._compiler.compile_grammar(c.spec)

    def _compile_schema(self, schema: str) -> xgr.CompiledGrammar:
        """A JSON schema through its EBNF, with xgrammar's length-limited string rule fixed:
        it allows raw control characters (U+0000..U+001F but CR and LF), which strict JSON
        forbids inside strings; here those characters are excluded (their escapes were not
        allowed there either, so such strings hold plain characters only)."""
        grammar = str(
            xgr.Grammar.from_json_schema(
                schema, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        )
        return self._compiler.compile_grammar(grammar.replace(_LOOSE_CHAR, _JSON_CHAR))
