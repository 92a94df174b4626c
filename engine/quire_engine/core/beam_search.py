"""Beam search over the paged cache: beams are sequences that fork (sharing every block, copy-on-
write on the last partial one) and are pruned (their blocks freed) as the search moves on.

All active beams of a request advance together: a beam whose next-token log-probabilities are in
waits (the scheduler skips a sequence with nothing to compute) until every sibling's are, then
``advance`` ranks all (beam, token) extensions by cumulative log-probability and keeps the best
``width``. A candidate ending in EOS (unless ``ignore_eos``) within the top ``width`` ranks is
retired as a finished hypothesis. Final beams are sorted by cumulative log-probability.

Pure Python: the engine hands each beam's best ``candidates_per_beam(width)`` tokens in as plain
lists (``TopTokens``, from a top-k over its log-softmax row), which is all the ranking can use.
The search state itself is ``core.beam_state.BeamState``, held by the request.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq
from typing import Any

from quire_engine.core.beam_state import BeamState, TopTokens
from quire_engine.core.outputs import CompletionOutput
from quire_engine.core.request_table import Request, RequestTable
from quire_engine.core.sequence import FinishReason

__all__ = ["BeamState", "TopTokens", "advance", "candidates_per_beam", "outputs", "rank"]


def candidates_per_beam(width: int) -> int:
    """Tokens per beam that can matter: at most ``width`` are kept, and at most ``width`` EOS
    candidates are retired."""
    return 2 * width


def rank(beams: Seq[tuple[str, float, TopTokens]], width: int) -> list[tuple[float, str, int]]:
    """All (cumulative + logprob, beam, token) extensions, best first; ties keep beam order then
    token id order, so the result is deterministic. Each beam brings its top
    ``candidates_per_beam(width)`` tokens."""
    cands = []
    for order, (sid, cum, top) in enumerate(beams):
        for v, t in zip(top.logprobs, top.token_ids, strict=True):
            cands.append((cum + v, order, t, sid))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(score, sid, tok) for score, _, tok, sid in cands]


def advance(table: RequestTable, req: Request, state: BeamState, eos: Collection[int]) -> None:
    """Choose the next beams and apply the choice through the request table: forks first (they
    need their parent alive), then appends, then pruning of beams nobody continues. ``eos``:
    the model's end-of-sequence token ids."""
    beams = [(sid, state.cumulative.get(sid, 0.0), state.pending[sid]) for sid in state.active]
    chosen: list[tuple[float, str, int]] = []
    for position, (score, sid, tok) in enumerate(rank(beams, state.width)):
        if len(chosen) == state.width:
            break
        if tok in eos and not state.ignore_eos:
            if position < state.width:
                seq = table.owner(sid)[1].seq
                state.finished.append(([*seq.output_token_ids, tok], score, FinishReason.STOP))
            continue
        chosen.append((score, sid, tok))
    state.pending.clear()

    sched = table.scheduler
    used: set[str] = set()
    plan = []  # (sequence, token, score)
    for score, sid, tok in chosen:
        parent = table.owner(sid)[1]
        seq = parent.seq
        if sid in used:
            child_id = f"{req.request_id}/b{next(state._ids)}"
            seq = table.fork(req, parent, child_id, index=len(req.samples), generator=None).seq
        used.add(sid)
        plan.append((seq, tok, score))
    for sid in state.active:
        if sid not in used:
            table.retire(req, table.owner(sid)[1])
    state.active = []
    state.cumulative = {}
    for seq, tok, score in plan:
        if sched.append(seq, tok):  # reached max_tokens / max_model_len
            state.finished.append((list(seq.output_token_ids), score, FinishReason.LENGTH))
            table.retire(req, table.owner(seq.seq_id)[1])
        else:
            state.active.append(seq.seq_id)
            state.cumulative[seq.seq_id] = score


def outputs(tokenizer: Any, state: BeamState) -> list[CompletionOutput]:
    best = sorted(state.finished, key=lambda f: -f[1])[: state.width]
    return [
        CompletionOutput(
            index=i,
            text=str(tokenizer.decode(tokens, skip_special_tokens=True)),
            token_ids=tokens,
            cumulative_logprob=score,
            finish_reason=reason,
        )
        for i, (tokens, score, reason) in enumerate(best)
    ]
