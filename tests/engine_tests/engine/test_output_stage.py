"""The output stage without a model: steps driven with chosen tokens on the core objects.

A real ``Scheduler`` (small pool) and ``RequestTable`` hold the requests; each step's logits are
one-hot rows picking the tokens the test names per sequence, so the step's batch (the plain
greedy lane or the planned rows) and the ``OutputProcessor`` run exactly as in the engine, and
the reports are checked exactly: stop strings cut (or kept), stop token ids, EOS, forks of
``n > 1`` samples, and a failing request finished alone while its batch-mates go on.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from quire_engine.core.config import CacheConfig, SchedulerConfig
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.request_table import Request, RequestTable
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import Sequence
from quire_engine.engine.output_processor import OutputProcessor
from quire_engine.engine.step_batch import GreedyBatch, PlannedBatch, StepBatch
from quire_engine.model.sampler import greedy_tokens, sample

TEXT = "abcdefghijklmn"  # token t < 14 decodes to TEXT[t]
POISON = 14  # decoding it raises
EOS = 15
VOCAB = 16


class CharTokenizer:
    """One character per token; EOS decodes to nothing, ``POISON`` raises."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if POISON in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return "".join(TEXT[i] for i in ids if i != EOS)


class Stage:
    """The engine's step after the forward, on core objects; tokens are chosen per sequence."""

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
            CacheConfig(num_blocks=32, block_size=4, enable_prefix_caching=False),
        )
        self.requests = RequestTable(self.scheduler, self.tokenizer)
        self.outputs = OutputProcessor(
            self.requests, self.scheduler, self.tokenizer, frozenset({EOS})
        )

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        """What ``LLMEngine.add_request`` builds for a request without beams or grammar."""
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset({EOS})
        )
        req = Request(rid, None, prompt, params, stop_ids=stop_ids)
        seq = Sequence(f"{rid}/0", prompt, max_tokens=params.max_tokens, reserved_seqs=params.n)
        gen = None if params.greedy else torch.Generator().manual_seed(params.seed or 0)
        self.requests.add(req, self.requests.new_sample(req, seq, 0, gen))

    def step(self, tokens: Mapping[str, int]) -> dict[str, RequestOutput]:
        """One step in which sequence ``seq_id`` picks ``tokens[seq_id]``; reports by id."""
        out = self.scheduler.schedule()
        rows = [seq.seq_id for seq, samples in zip(out.seqs, out.samples, strict=True) if samples]
        logits = torch.zeros(len(rows), VOCAB)
        for row, seq_id in enumerate(rows):
            logits[row, tokens[seq_id]] = 1e4  # one-hot: every sampler path picks it
        batch: StepBatch
        if self.requests.all_plain_greedy:
            batch = GreedyBatch(out, self.outputs)
        else:
            batch = PlannedBatch(out, self.outputs, self._generator, self._no_grammar)
        batch.sample(logits, sample, greedy_tokens)
        batch.update(self.scheduler)
        return {o.request_id: o for o in batch.process()}

    @staticmethod
    def _generator(req: Request, j: int) -> torch.Generator:
        return torch.Generator().manual_seed(100 + j)

    @staticmethod
    def _no_grammar(grammars: list[object]) -> torch.Tensor:
        raise AssertionError("no request here has a grammar")


Final = list[tuple[str, list[int], str | None, str | int | None]]


def final(report: RequestOutput) -> Final:
    return [(o.text, list(o.token_ids), o.finish_reason, o.stop_reason) for o in report.outputs]


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_string_finishes_and_is_cut_unless_kept(keep: bool) -> None:
    stage = Stage()
    params = SamplingParams(
        temperature=0.0, max_tokens=10, stop=("cd",), include_stop_str_in_output=keep
    )
    stage.add("r", [0, 1], params)
    assert final(stage.step({"r/0": 0})["r"]) == [("a", [0], None, None)]
    assert not stage.step({"r/0": 2})["r"].finished
    done = stage.step({"r/0": 3})["r"]  # "acd": the stop string ends here
    assert done.finished and done.error is None
    assert final(done) == [("acd" if keep else "a", [0, 2, 3], "stop", "cd")]
    assert len(stage.requests) == 0 and not stage.scheduler.has_unfinished()


def test_a_stop_token_id_and_eos_finish_and_ignore_eos_does_not() -> None:
    stage = Stage()
    stage.add("stop-id", [0], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(4,)))
    stage.add("eos", [0], SamplingParams(temperature=0.0, max_tokens=10))
    stage.add("ignore", [0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    first = stage.step({"stop-id/0": 1, "eos/0": 1, "ignore/0": 1})
    assert [first[r].finished for r in ("stop-id", "eos", "ignore")] == [False, False, False]
    second = stage.step({"stop-id/0": 4, "eos/0": EOS, "ignore/0": EOS})
    assert final(second["stop-id"]) == [("be", [1, 4], "stop", 4)]
    assert final(second["eos"]) == [("b", [1, EOS], "stop", None)]  # EOS: no stop_reason
    assert final(second["ignore"]) == [("b", [1, EOS], "length", None)]
    assert len(stage.requests) == 0 and stage.scheduler.kv.stats().used == 0


def test_a_failing_request_is_finished_alone_while_its_batch_mates_go_on() -> None:
    stage = Stage()
    for rid in ("a", "bad", "c"):
        stage.add(rid, [0, 1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    stage.step({"a/0": 2, "bad/0": 2, "c/0": 2})
    reports = stage.step({"a/0": 3, "bad/0": POISON, "c/0": 4})
    bad = reports["bad"]
    assert bad.finished and bad.error is not None and "UnicodeDecodeError" in bad.error
    assert final(bad) == [("c", [2, POISON], "abort", None)]
    assert not reports["a"].finished and not reports["c"].finished
    last = stage.step({"a/0": 5, "c/0": 6})
    assert set(last) == {"a", "c"}
    assert final(last["a"]) == [("cdf", [2, 3, 5], "length", None)]
    assert final(last["c"]) == [("ceg", [2, 4, 6], "length", None)]
    assert len(stage.requests) == 0 and stage.scheduler.kv.stats().used == 0


def test_n_samples_fork_on_the_first_token_and_go_their_own_ways() -> None:
    stage = Stage()
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True)
    stage.add("fan", [0, 1, 2], params)
    stage.add("one", [0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    first = stage.step({"fan/0": 5, "one/0": 1})
    assert [(o.index, o.text, list(o.token_ids)) for o in first["fan"].outputs] == [
        (0, "f", [5]), (1, "f", [5]), (2, "f", [5])
    ]  # fmt: skip
    assert sorted(stage.scheduler.seqs) == ["fan/0", "fan/1", "fan/2", "one/0"]
    stage.step({"fan/0": 6, "fan/1": 7, "fan/2": 8, "one/0": 2})
    done = stage.step({"fan/0": 9, "fan/1": 10, "fan/2": 11, "one/0": 3})
    assert final(done["fan"]) == [
        ("fgj", [5, 6, 9], "length", None),
        ("fhk", [5, 7, 10], "length", None),
        ("fil", [5, 8, 11], "length", None),
    ]
    assert final(done["one"]) == [("bcd", [1, 2, 3], "length", None)]
    assert len(stage.requests) == 0 and stage.scheduler.kv.stats().used == 0


def test_the_plain_greedy_lane_and_the_planned_rows_report_alike() -> None:
    def run(planned: bool) -> list[dict[str, Final]]:
        stage = Stage()
        stage.add("s", [0], SamplingParams(temperature=0.0, max_tokens=8, stop=("e",)))
        stage.add("e", [1], SamplingParams(temperature=0.0, max_tokens=8))
        if planned:  # a logprobs request keeps every step off the lane
            stage.add("lp", [2], SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))
        picks = [{"s/0": 3, "e/0": 0}, {"s/0": 4, "e/0": EOS}]
        steps = []
        for pick in picks:
            reports = stage.step({**pick, "lp/0": 0})
            steps.append({r: final(o) for r, o in reports.items() if r != "lp"})
        return steps

    expected = [
        {"s": [("d", [3], None, None)], "e": [("a", [0], None, None)]},
        {"s": [("d", [3, 4], "stop", "e")], "e": [("a", [0, EOS], "stop", None)]},
    ]
    assert run(planned=False) == run(planned=True) == expected
