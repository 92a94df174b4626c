"""Prompt logprobs: the extra logits rows a step computes for requests that asked for them.

A step with requests that want ``prompt_logprobs`` asks the runner for more rows than it samples
(``core.scheduler.prompt_logit_spans``: per prefill chunk, the rows of its prompt positions);
``PromptLogprobs.split`` records the logprobs those rows give into each request's
``prompt_logprobs`` list (owned by its ``Request`` in the ``RequestTable``) and returns the
sampling rows alone. A recomputed prompt (after preemption) computes its rows again: positions
already recorded are skipped. A failure while recording fails that request only.
"""

from __future__ import annotations

import torch

from quire_engine.core.request_table import Request
from quire_engine.core.scheduler import PromptLogitSpan
from quire_engine.engine.output_processor import OutputProcessor


class PromptLogprobs:
    def __init__(self, outputs: OutputProcessor) -> None:
        self.outputs = outputs

    def split(self, spans: list[PromptLogitSpan], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [sampling rows + the spans' rows, vocab] -> the sampling rows, after
        recording the spans' prompt logprobs."""
        num_sampling = len(logits) - sum(s.rows for s in spans)
        self._record(spans, logits[num_sampling:])
        return logits[:num_sampling]

    def _record(self, spans: list[PromptLogitSpan], logits: torch.Tensor) -> None:
        """Append the prompt logprobs these rows give, for positions not recorded yet."""
        logprobs = torch.log_softmax(logits, dim=-1)
        owner, isolated = self.outputs.requests.owner, self.outputs.isolated
        row = 0
        for span in spans:
            req, _ = owner(span.seq.seq_id)
            rows = logprobs[row : row + span.rows]
            row += span.rows
            isolated(req, _append, req, span, rows)


def _append(req: Request, span: PromptLogitSpan, logprobs: torch.Tensor) -> None:
    """``logprobs`` [span.rows, vocab]: row k predicts prompt token ``span.first + k + 1``."""
    recorded = req.prompt_logprobs
    assert recorded is not None
    skip = len(recorded) - (span.first + 1)  # rows whose positions are already recorded
    if skip >= span.rows:
        return
    rows = logprobs[max(skip, 0) :]
    targets = req.prompt_token_ids[span.first + 1 + max(skip, 0) : span.first + 1 + span.rows]
    ids = torch.tensor(targets, device=rows.device).unsqueeze(1)
    chosen = rows.gather(1, ids).squeeze(1).tolist()
    k = req.params.prompt_logprobs or 0
    top_values, top_ids = rows.topk(k) if k else (None, None)
    for n, (token, lp) in enumerate(zip(targets, chosen, strict=True)):
        entry = {token: lp}
        if top_values is not None and top_ids is not None:
            entry.update(zip(top_ids[n].tolist(), top_values[n].tolist(), strict=True))
        recorded.append(entry)
