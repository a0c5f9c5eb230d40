"""The compile line (pretrain/compile_report.py) from dynamo's phase timers, faked here: the phases since
the snapshot, dynamo's own share (frames less the backend) with the kernel registry's measuring in it,
timers a torch release lacks left out, nothing said for an eager run. A real compiled run's line is
checked in tests/test_compile_blocks.py."""
import pytest

from kernels import registry
from pretrain import compile_report


@pytest.fixture
def timers(monkeypatch):
    import torch._dynamo.utils as utils

    fake = {}
    monkeypatch.setattr(utils, "compilation_time_metrics", fake)
    registry.reset_choices()
    yield fake
    registry.reset_choices()


def test_the_phases_since_the_snapshot(timers):
    timers.update({"_compile.compile_inner": [5.0], "OutputGraph.call_user_compiler": [4.0]})
    before = compile_report.snapshot()
    timers["_compile.compile_inner"] += [30.0, 12.0]  # two frames (compile_scope=blocks: one per block)
    timers["OutputGraph.call_user_compiler"] += [20.0, 8.0]
    timers["backward._backward_impl"] = [15.5]
    timers["async_compile.wait"] = [9.25]
    registry._choices["attention"] = {("k", ("triton", "sdpa")): registry.Choice("attention", "k", "k", "triton",
                                                                                {"triton": 1.0}, took_s=6.0)}
    registry._choices["attention"][("j", ("a", "b"))] = registry.Choice("attention", "j", "j", "a", {"a": 1.0},
                                                                        took_s=50.0, kept="the checkpoint")
    assert compile_report.line(1, before) == (
        "compile: 57.5 s by step 1: dynamo 14.0 s (of it measuring kernel paths 6.0 s), the forward 28.0 s, "
        "the backward 15.5 s; waiting for parallel Triton and C++ builds 9.2 s of those")
    assert compile_report.line(1, before, measuring_before=6.0).startswith("compile: 57.5 s by step 1: dynamo 14.0 s, ")


def test_missing_timers_are_left_out_and_an_eager_run_says_nothing(timers):
    before = compile_report.snapshot()
    assert before == {} and compile_report.line(1, before) is None  # nothing compiled
    timers["_compile.compile_inner"] = [3.0]  # a release without the backend's and backward's timers
    assert compile_report.line(2, before) == "compile: 3.0 s by step 2: dynamo and the forward 3.0 s"
    timers["compile_fx.<locals>.bw_compiler"] = [1.0]  # the backward's other name
    assert compile_report.line(2, before) == "compile: 4.0 s by step 2: dynamo and the forward 3.0 s, the backward 1.0 s"
