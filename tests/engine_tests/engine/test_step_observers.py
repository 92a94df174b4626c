"""Instrumentation watches the engine through its observer seam: an observer added with
``LLMEngine.add_observer`` sees every step (its schedule and CPU time) until removed, and the
profile attaches and detaches through it without replacing any engine or runner method."""

from __future__ import annotations

from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm import LLM
from quire_engine.engine.observer import StepRecord
from quire_engine.engine.profile import StepProfile

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def on_step(self, step: StepRecord) -> None:
        self.steps.append(step)


def test_an_observer_sees_every_step_until_removed() -> None:
    llm = LLM(num_blocks=64, max_model_len=64)
    engine = llm.engine
    recorder = Recorder()
    engine.add_observer(recorder)
    engine.add_request("r", [1, 2, 3], GREEDY)
    reported = 0
    while engine.has_unfinished():
        engine.step()
        reported += 1
    assert engine.step() == []  # an empty step is observed too
    assert len(recorder.steps) == reported + 1
    assert [len(s.schedule.seqs) for s in recorder.steps] == [1] * reported + [0]
    assert all(s.cpu_ns >= 0 for s in recorder.steps)
    engine.remove_observer(recorder)
    llm.generate([[4, 5]], GREEDY)
    assert len(recorder.steps) == reported + 1


def test_the_profile_counts_steps_through_the_seam_and_detaches() -> None:
    llm = LLM(num_blocks=64, max_model_len=64)
    engine = llm.engine
    profile = StepProfile()
    with profile.attach(engine):
        assert engine.runner.forward_observer is profile
        llm.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert profile.steps == 4  # one prefill step, then one per further token
    assert profile.ns["step"] > 0 and profile.ns["forward"] > 0
    assert set(profile.report()["split_s"]) == {
        "matmuls", "attention", "forward_other", "native_decoder", "step_python",
    }  # fmt: skip
    assert engine.runner.forward_observer is None
    assert "step" not in vars(engine) and "_native_step" not in vars(engine.runner)
    llm.generate([[6]], GREEDY)
    assert profile.steps == 4
