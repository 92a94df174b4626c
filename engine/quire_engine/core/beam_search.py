"""Beam search over the paged cache: beams are sequences that fork (sharing every block, copy-on-
write on the last partial one) and are pruned (their blocks freed) as the search moves on.

All active beams of a request advance together: a beam whose next-token log-probabilities are in
waits (the scheduler skips a sequence with nothing to compute) until every sibling's are, then
``advance`` ranks all (beam, token) extensions by cumulative log-probability and keeps the best
``width``. A candidate ending in EOS (unless ``ignore_eos``) within the top ``width`` ranks is
retired as a finished hypothesis. Final beams are sorted by cumulative log-probability.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from quire_engine.core.outputs import CompletionOutput

if TYPE_CHECKING:
    from quire_engine.core.request_table import Request, RequestTable


@dataclass(slots=True)
class BeamState:
    width: int
    ignore_eos: bool
    active: list[str] = field(default_factory=list)  # sequence ids of live beams
    cumulative: dict[str, float] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # seq id -> [vocab] logprobs
    finished: list[tuple[list[int], float, str]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"beam_width must be >= 1; got {self.width}")

    @property
    def ready(self) -> bool:
        return bool(self.active) and all(sid in self.pending for sid in self.active)

    @property
    def done(self) -> bool:
        return not self.active


def rank(beams: Seq[tuple[str, float, torch.Tensor]], width: int) -> list[tuple[float, str, int]]:
    """All (cumulative + logprob, beam, token) extensions, best first; ties keep beam order then
    token id order, so the result is deterministic. Only each beam's top ``2 * width`` tokens can
    matter (at most ``width`` are kept, and at most ``width`` EOS candidates are retired)."""
    cands = []
    for order, (sid, cum, logprobs) in enumerate(beams):
        k = min(2 * width, logprobs.shape[0])
        values, ids = logprobs.topk(k)
        for v, t in zip(values.tolist(), ids.tolist(), strict=True):
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
                state.finished.append(([*seq.output_token_ids, tok], score, "stop"))
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
            state.finished.append((list(seq.output_token_ids), score, "length"))
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
