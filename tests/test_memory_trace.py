"""PRETRAIN_MEMORY_TRACE (pretrain/memory_trace.py): the allocator's record of a GPU run's first steps, read
into where its peak memory went. The reading is checked on hand-made records on the CPU; the recording itself
against torch.cuda.max_memory_allocated on a GPU (`gpu` marker)."""
import os
import pickle

import pytest
import torch
from trainer_helpers import tiny_overrides, write_markov_corpus

from pretrain import memory_trace
from pretrain.memory_trace import ROOT, report

MIB = 2 ** 20
GPN = os.path.join(ROOT, "pretrain", "models", "gpn.py")
TRAINER = os.path.join(ROOT, "pretrain", "trainer.py")


def frames(*where):
    """A stack, innermost first, from (file, line, function) triples."""
    return [{"filename": f, "line": n, "name": name} for f, n, name in where]


def alloc(addr, mib, stack):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": stack}


def free(addr, mib, completed=True):
    out = [{"action": "free_requested", "addr": addr, "size": mib * MIB, "frames": []}]
    return out + ([{"action": "free_completed", "addr": addr, "size": mib * MIB, "frames": []}] if completed else [])


def test_the_peak_and_what_was_alive_then_by_the_project_line_that_allocated_it():
    torch_inner = ("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
    segment = frames(torch_inner, (GPN, 300, "_segment_forward"), (TRAINER, 440, "_forward_backward"))
    head = frames((GPN, 500, "loss"), (TRAINER, 440, "_forward_backward"))
    compiled = frames(("/tmp/torchinductor_me/ab/cab.py", 7, "call"), (GPN, 200, "forward"))
    events = [
        alloc(1, 60, segment), alloc(2, 100, segment), *free(1, 60),
        alloc(3, 50, head), alloc(4, 30, compiled), alloc(5, 20, []),  # the peak: 100 + 50 + 30 + 20 (+ 64 from before) = 264 MiB
        *free(2, 100), *free(99, 64),  # 99: allocated before the record began
        {"action": "segment_alloc", "addr": 7, "size": 512 * MIB, "frames": []},
        alloc(6, 10, head),
    ]
    # at the end: 3, 4, 5, 6 alive (110 MiB); the allocator said 110 MiB allocated, so the 64 freed were from before
    lines = report(events, allocated_end=110 * MIB)
    assert lines[0].startswith("peak 0.26 GiB allocated, at event 7 of 13, reached by 20.0 MiB from no Python frame")
    body = lines[2:]
    assert len(body) == 5, lines
    assert body[0].split()[:4] == ["0.10", "38%", "1", "x"] and body[0].endswith("pretrain/models/gpn.py:300 (_segment_forward)")
    assert body[1].split()[:2] == ["0.06", "24%"] and body[1].endswith("allocated before the record began")
    assert body[2].split()[:2] == ["0.05", "19%"] and body[2].endswith("pretrain/models/gpn.py:500 (loss)")
    assert body[3].endswith("pretrain/models/gpn.py:200 (forward), compiled")
    assert "no Python frame" in body[4]
    # the cap on places: the rest in one line
    short = report(events, allocated_end=110 * MIB, top=2)
    assert short[-1].split()[:2] == ["0.10", "38%"] and short[-1].endswith("blocks at 3 other places"), short


def test_a_free_counts_when_requested_and_a_record_with_no_events_or_peak_says_so():
    stack = frames((GPN, 1, "f"))
    # 2's free is requested before 3 is allocated and completes after it (another stream still reading it):
    # the allocated bytes (what max_memory_allocated follows) drop at the request
    events = [alloc(1, 10, stack), alloc(2, 10, stack), *free(2, 10, completed=False), alloc(3, 10, stack),
              {"action": "free_completed", "addr": 2, "size": 10 * MIB, "frames": []}]
    assert report(events, 20 * MIB)[0].startswith("peak 0.02 GiB allocated, at event 2 of 5")
    assert report([], 0) == ["no allocator events were recorded"]
    assert report([*free(9, 10)], 0)[0] == "peak 0.01 GiB allocated, all of it before the record began"


def test_the_stack_of_the_peak_is_the_projects_frames_outermost_first():
    stack = frames(("/x/torch/y.py", 1, "inner"), (GPN, 300, "_segment_forward"), (TRAINER, 440, "_forward_backward"))
    assert memory_trace.stack(stack) == "pretrain/trainer.py:440 (_forward_backward) > pretrain/models/gpn.py:300 " \
        "(_segment_forward)"
    assert memory_trace.site(frames(("/x/torch/y.py", 1, "inner"))) == "y.py:1 (inner), outside the project's code"
    backward = frames(("/tmp/torchinductor_me/q7/cq7.py", 88, "call"), ("/x/torch/_functorch/w.py", 5, "backward"))
    assert memory_trace.site(backward) == "compiled code cq7.py:88 (call), no project frame"


def test_a_bad_value_or_a_cpu_run_is_one_sentence_before_any_work(tmp_path, monkeypatch):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    monkeypatch.setenv(memory_trace.ENV, "two")
    with pytest.raises(ValueError, match=r"^PRETRAIN_MEMORY_TRACE='two': give the number of steps to record"):
        memory_trace.steps()
    monkeypatch.setenv(memory_trace.ENV, "2")
    prefix = write_markov_corpus(tmp_path / "corpus")
    cfg = load_config("baseline/tiny", tiny_overrides(tmp_path, prefix))
    with pytest.raises(ValueError, match=r"^PRETRAIN_MEMORY_TRACE=2 records the CUDA caching allocator, and this "
                                         r"run trains on the CPU; unset it$"):
        Trainer(cfg, log=lambda *a: None)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(memory_trace.ENV, "0")
    assert memory_trace.begin(torch.device("cpu")) == 0


@pytest.mark.parametrize("fail_at", [0, 2], ids=["after-its-steps", "an-error-first"])
def test_the_trainer_ends_the_record_after_its_steps_or_when_the_run_stops_first(tmp_path, monkeypatch, fail_at):
    """The wiring, on the CPU: recording starts before the model is built and ends once, after step N, or
    when a run stops before it (an error; the record is what shows where memory went before it)."""
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    calls = []
    monkeypatch.setattr(memory_trace, "begin", lambda device: calls.append(("begin",)) or 3)
    monkeypatch.setattr(memory_trace, "finish", lambda run_dir, rank, world, log, why: calls.append(("finish", why)))
    prefix = write_markov_corpus(tmp_path / "corpus")
    cfg = load_config("baseline/tiny", tiny_overrides(tmp_path, prefix, **{"train.max_steps": 5, "train.eval_every": 0,
                                                                           "checkpoint.every": 0}))
    trainer = Trainer(cfg, log=lambda *a: None)
    assert calls == [("begin",)]
    if fail_at:
        step = trainer._optimizer_step

        def failing(*a):
            if trainer.step == fail_at:
                raise RuntimeError("injected")
            step(*a)
        monkeypatch.setattr(trainer, "_optimizer_step", failing)
        with pytest.raises(RuntimeError, match="injected"):
            trainer.fit()
        assert calls[1:] == [("finish", "the run stopped in step 3")]
    else:
        trainer.fit()
        assert calls[1:] == [("finish", "step 3 ended")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the caching allocator's record)")
def test_on_a_gpu_the_records_peak_is_max_memory_allocated(tmp_path, monkeypatch):
    monkeypatch.setenv(memory_trace.ENV, "1")
    held = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")  # allocated before the record
    torch.cuda.reset_peak_memory_stats()
    assert memory_trace.begin(torch.device("cuda")) == 1
    a = torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")
    b = torch.empty(24 * MIB, dtype=torch.uint8, device="cuda")
    del a, held
    c = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
    lines = []
    memory_trace.finish(str(tmp_path), 0, 1, lines.append, "the test's end")
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    said = next(ln for ln in lines if "peak" in ln)
    assert f"peak {peak:,.2f} GiB allocated" in said, (peak, lines)
    with open(tmp_path / "memory_trace.pickle", "rb") as f:
        assert "device_traces" in pickle.load(f)
    del b, c
