"""Step reports are snapshots: an unfinished report holds ``Prefix`` views of the engine's
token and logprob lists, frozen at the step that produced them, and a finished one plain lists.
``Prefix`` behaves as a read-only sequence of its first ``n`` items."""

from __future__ import annotations

import pytest

from quire_engine.core.outputs import CompletionOutput, Prefix, RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm import LLM


def test_prefix_is_a_frozen_read_only_view() -> None:
    items = [10, 11, 12]
    view = Prefix(items, 2)
    items.append(13)  # the owner keeps appending
    assert len(view) == 2 and list(view) == [10, 11] and view == [10, 11] and view == (10, 11)
    assert view != [10, 11, 12] and view != [10] and view == Prefix(items, 2)
    assert view[0] == 10 and view[-1] == 11 and view[:5] == [10, 11] and view[1:] == [11]
    assert 11 in view and 12 not in view and view.index(11) == 1 and repr(view) == "[10, 11]"
    with pytest.raises(IndexError):
        view[2]  # exists in the list, not in the view
    with pytest.raises(IndexError):
        view[-3]
    with pytest.raises(TypeError):
        hash(view)


def test_reports_are_snapshots_of_their_step() -> None:
    engine = LLM(device="cpu", num_blocks=32, max_model_len=64, max_num_seqs=2).engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    engine.add_request("snap", [5, 6, 7, 8], params)
    reports: list[RequestOutput] = []
    while engine.has_unfinished():
        reports += engine.step()
    assert [r.finished for r in reports] == [False] * 4 + [True]
    final = reports[-1].outputs[0]
    assert type(final.token_ids) is list and type(final.logprobs) is list  # finished: lists
    assert len(final.token_ids) == 5
    for k, report in enumerate(reports[:-1], start=1):
        sample: CompletionOutput = report.outputs[0]
        assert isinstance(sample.token_ids, Prefix) and sample.finish_reason is None
        # Later steps appended to the same lists; each report still shows its own step.
        assert sample.token_ids == final.token_ids[:k]
        assert sample.logprobs is not None and list(sample.logprobs) == final.logprobs[:k]
