"""A step's planned sampling rows, sampled as one batch (tensor side, beside ``sampler``).

The engine plans one ``PlanRow`` per sampled token of a step (a request with ``n > 1`` plans
``n`` rows on its first token, all reading its one logits row); ``sample_rows`` draws them as one
batch and ``argmax_rows`` serves steps whose rows are all argmax-only. Both return one entry
per planned row, in plan order.

Fault isolation is the caller's contract, kept here: a failure of the batched draw falls back to
drawing each request's rows alone, and a request whose rows still raise is handed to ``fail``
(its rows get ``NOTHING``, never emitted); only a failure that no single request explains (the
argmax over the whole batch) propagates. Nothing here owns state: the rows' requests, samples and
generators belong to the engine's ``RequestTable``.

The kernels (``draw``, ``argmax``) and the grammar bitmask filler are parameters: the engine
passes them per step (benchmarks and fault tests wrap them there), and the bitmask comes from
the structured-outputs layer, above this one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from quire_engine.core.request_table import Request, Sample
from quire_engine.model.sampler import SampleResult, SampleRow, greedy_tokens, sample

logger = logging.getLogger(__name__)

# What the engine hands in: the sampler, the argmax, a request's failure, and the grammar
# bitmask of a list of matchers (int32 [len(matchers), ceil(vocab / 32)]).
DrawFn = Callable[[torch.Tensor, list[SampleRow]], SampleResult]
ArgmaxFn = Callable[[torch.Tensor], torch.Tensor]
FailFn = Callable[[Request, BaseException], None]
BitmaskFn = Callable[[list[Any]], torch.Tensor]


class Sampled(NamedTuple):
    """What sampling chose for one planned row."""

    token: int
    logprob: float | None  # the token's, when the request asked for logprobs
    top: dict[int, float] | None  # the top logprobs by token id, when asked for


NOTHING = Sampled(0, None, None)  # the row of a failed request: never emitted


class PlanRow(NamedTuple):
    """One planned sampling row of a step."""

    request: Request
    sample: Sample  # the sample it continues (the parent, for a sample forked this step)
    sample_index: int  # j within the request (j > 0: forked this step, n > 1)
    logits_row: int  # its row of the step's logits
    generator: torch.Generator | None  # the RNG it draws from


def argmax_rows(logits: torch.Tensor, num_rows: int, argmax: ArgmaxFn = greedy_tokens) -> list[int]:
    """Plain greedy rows, plan row k = logits row k: one argmax over the batch. Nothing here
    depends on one request, so a failure is the batch's (it propagates)."""
    if logits.shape[0] != num_rows:
        raise ValueError(f"{logits.shape[0]} logit rows for {num_rows} sampling rows")
    ids: list[int] = argmax(logits).tolist()
    return ids


def sample_rows(
    logits: torch.Tensor,
    plan: list[PlanRow],
    *,
    bitmask: BitmaskFn,
    fail: FailFn,
    draw: DrawFn = sample,
) -> list[Sampled]:
    """(token, its logprob, top logprobs) per planned row, sampled as one batch. If the batch
    raises, each request's rows are sampled alone and only the requests that still raise
    fail (their rows get token 0, never used). A request whose generator advanced in the
    failed batched attempt draws differently in that one step."""
    rows = [
        SampleRow(
            req.params,
            gen,
            smp.seq.output_token_ids,
            req.prompt_token_ids,
            req.stop_ids,
            req.bad_words,
        )
        for req, smp, _, _, gen in plan
    ]
    live = [k for k, (req, _, _, _, _) in enumerate(plan) if req.error is None]
    results: list[Sampled] = [NOTHING] * len(plan)
    if not live:
        return results
    # Structured outputs: one batched bitmask for every constrained row (a row forked this
    # step masks with its parent's matcher: both stand at the first token).
    constrained = [k for k in live if plan[k].sample.grammar is not None]
    if constrained:
        words = bitmask([plan[k].sample.grammar for k in constrained])
        for g, k in enumerate(constrained):
            rows[k].token_mask = words[g]
    try:
        picked = draw(logits[[plan[k].logits_row for k in live]], [rows[k] for k in live])
        scatter(results, live, picked)
        return results
    except Exception:
        logger.warning("batched sampling raised; sampling each request alone", exc_info=True)
    groups: dict[str, list[int]] = {}
    for k in live:
        groups.setdefault(plan[k].request.request_id, []).append(k)
    for ks in groups.values():
        req = plan[ks[0]].request
        try:
            result = draw(logits[[plan[k].logits_row for k in ks]], [rows[k] for k in ks])
        except Exception as exc:
            fail(req, exc)
            continue
        scatter(results, ks, result)
    return results


def scatter(results: list[Sampled], where: list[int], result: SampleResult) -> None:
    """Write ``result``'s row ``n`` into ``results[where[n]]``."""
    for n, k in enumerate(where):
        lp = result.logprobs[n] if result.logprobs is not None else None
        top = result.top_logprobs[n] if result.top_logprobs is not None else None
        results[k] = Sampled(result.token_ids[n], lp, top)
