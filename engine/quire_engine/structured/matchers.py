"""Per-sample grammar matchers and the batched token bitmask of a step.

Ownership: each constrained sample owns one ``xgrammar.GrammarMatcher`` (kept opaque in the
core's ``Sample.grammar``), created by the engine thread and advanced only there, one accepted
token per step. A matcher's state is the tokens it accepted, not KV: preemption (recompute or
swap) leaves it as it is, and a sample forked at its first token (n > 1) gets a fresh matcher
that accepts its own first token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

_BATCH = xgr.BatchGrammarMatcher(max_threads=1)


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(compiled)


def fill_bitmask(matchers: Sequence[xgr.GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each matcher: int32 ``[len(matchers), ceil(vocab / 32)]``,
    bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (on the CPU)."""
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    _BATCH.batch_fill_next_token_bitmask(list(matchers), bitmask)
    return bitmask


def accept(matcher: xgr.GrammarMatcher, token: int) -> bool:
    """Advance by ``token``; False when the grammar does not allow it (a bug upstream)."""
    return bool(matcher.accept_token(token))


def terminated(matcher: xgr.GrammarMatcher) -> bool:
    """The grammar is complete and its stop token was accepted."""
    return bool(matcher.is_terminated())
