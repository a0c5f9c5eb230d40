"""The compile line (pretrain/compile_report.py) from dynamo's phase timers, faked here: the phases since
the snapshot, dynamo's own share (frames less the backend) with the kernel registry's traced measuring in
it, a measured candidate's nested compile counted once, measuring outside a trace said apart, timers a
torch release lacks left out, nothing said for an eager run. A real compiled run's line is checked in
tests/test_compile_blocks.py."""
import pytest

from kernels import registry
from pretrain import compile_report


@pytest.fixture
def timers(monkeypatch):
    import torch._dynamo.utils as utils

    fake = {}
    monkeypatch.setattr(utils, "compilation_time_metrics", fake)
    monkeypatch.setattr(registry, "nested_compile_s", {})
    registry.reset_choices()
    yield fake
    registry.reset_choices()


def _choice(key, took_s, traced=True, kept=""):
    registry._choices.setdefault("attention", {})[(key, ("a", "b"))] = registry.Choice(
        "attention", key, key, "a", {"a": 1.0}, took_s=took_s, traced=traced, kept=kept)


def test_the_phases_since_the_snapshot(timers):
    timers.update({"_compile.compile_inner": [5.0], "OutputGraph.call_user_compiler": [4.0]})
    before, measuring_before = compile_report.snapshot(), compile_report.measured_seconds()
    timers["_compile.compile_inner"] += [30.0, 12.0]  # two frames (compile_scope=blocks: one per block)
    timers["OutputGraph.call_user_compiler"] += [20.0, 8.0]
    timers["backward._backward_impl"] = [15.5]
    timers["async_compile.wait"] = [9.25]
    _choice("k", 6.0)  # measured at trace time: inside the 30 s frame
    _choice("j", 50.0, kept="the checkpoint")  # kept: cost nothing in this process
    assert compile_report.line(1, before, measuring_before) == (
        "compile: 57.5 s by step 1: dynamo 14.0 s (of it measuring kernel paths 6.0 s), the forward 28.0 s, "
        "the backward 15.5 s; waiting for parallel Triton and C++ builds 9.2 s of those")
    _choice("e", 2.0, traced=False)  # an eager call's measurement: not compile time
    assert compile_report.line(1, before, measuring_before).endswith(
        "; measuring kernel paths outside the compile 2.0 s more")


def test_a_measured_candidates_own_compile_is_counted_once(timers):
    before = compile_report.snapshot()
    # the model's frame took 40 s, 25 s of it measuring; inside, FlexAttention's frame (3 s + 9 s backend)
    # and its lazily compiled backward (10 s) were timed too, and the registry noted them
    timers.update({"_compile.compile_inner": [3.0, 40.0], "OutputGraph.call_user_compiler": [9.0, 12.0],
                   "backward._backward_impl": [10.0, 6.0]})
    registry.nested_compile_s.update({"_compile.compile_inner": 3.0, "OutputGraph.call_user_compiler": 9.0,
                                      "backward._backward_impl": 10.0})
    _choice("k", 25.0)
    assert compile_report.line(1, before) == (
        "compile: 46.0 s by step 1: dynamo 28.0 s (of it measuring kernel paths 25.0 s), the forward 12.0 s, "
        "the backward 6.0 s")


def test_missing_timers_are_left_out_and_an_eager_run_says_nothing(timers):
    before = compile_report.snapshot()
    assert before == {} and compile_report.line(1, before) is None  # nothing compiled
    timers["_compile.compile_inner"] = [3.0]  # a release without the backend's and backward's timers
    assert compile_report.line(2, before) == "compile: 3.0 s by step 2: dynamo and the forward 3.0 s"
    timers["compile_fx.<locals>.bw_compiler"] = [1.0]  # an early backward: inside the frame's time already
    assert compile_report.line(2, before) == "compile: 3.0 s by step 2: dynamo and the forward 3.0 s"
