"""The progress line's time split (pretrain/phase_timer.py): data, forward, backward, optimizer
(gradient clipping included) and other add up to the steps' wall time; on a GPU the compute phases
are CUDA events read only after the step's own sync (here with a fake event; on CUDA: `gpu` marker)."""
import time

import pytest
import torch

from pretrain import phase_timer
from pretrain.config import load_config
from pretrain.metrics import progress_line
from pretrain.phase_timer import PhaseTimer
from pretrain.trainer import Trainer
from trainer_helpers import tiny_overrides


class FakeEvent:
    """A device event on a clock the test moves; counts its reads."""

    device_ms = 0.0
    reads = 0

    def record(self):
        self.at = FakeEvent.device_ms

    def elapsed_time(self, end):
        FakeEvent.reads += 1
        return end.at - self.at


def test_events_are_read_only_when_resolved_and_data_keeps_the_host_clock(monkeypatch):
    host = [100.0]
    monkeypatch.setattr(phase_timer.time, "perf_counter", lambda: host[0])
    FakeEvent.device_ms, FakeEvent.reads = 0.0, 0
    timer = PhaseTimer(torch.device("cpu"), event=FakeEvent)

    def phase(name, host_s, device_ms):
        host[0] += host_s
        FakeEvent.device_ms += device_ms
        timer.mark(name)

    timer.start()
    phase("data", 0.5, 1.0)  # host clock: 0.5 s, whatever the device did meanwhile
    for _ in range(2):  # two micro batches; the host only queues (1 ms), the device runs
        phase("forward", 0.001, 30.0)
        phase("backward", 0.001, 60.0)
    assert FakeEvent.reads == 0  # nothing read (a read would wait for the device) before resolve
    seconds = timer.resolve()
    assert FakeEvent.reads == 4
    assert seconds == pytest.approx({"data": 0.5, "forward": 0.06, "backward": 0.12, "optimizer": 0.0})
    phase("optimizer", 0.002, 20.0)  # after the step's sync: read at the next one
    assert timer.resolve()["optimizer"] == pytest.approx(0.02) and FakeEvent.reads == 5
    assert timer.resolve()["forward"] == pytest.approx(0.06) and FakeEvent.reads == 5  # each event pair once


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_the_split_adds_up_to_the_steps_with_clipping_in_opt(tmp_path, corpus, threads):
    """Slowed on purpose: each micro batch's fetch by 0.05 s (data), finish_grads (clipping) by 0.2 s
    (optimizer), a checkpoint inside the window by 0.3 s (other)."""
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 3, "train.log_every": 3, "train.eval_every": 0,
                                               "schedule.warmup_steps": 1, "checkpoint.every": 2})
    lines = []
    trainer = Trainer(load_config("baseline/tiny", over), log=lines.append)
    loader, finish_grads, save = trainer._loader, trainer.engine.finish_grads, trainer.save

    def slow_batches():
        for batch in loader():
            time.sleep(0.05)
            yield batch

    def slow(fn, seconds):
        def run(*args):
            time.sleep(seconds)
            return fn(*args)
        return run

    trainer._loader = slow_batches
    trainer.engine.finish_grads = slow(finish_grads, 0.2)
    trainer.save = slow(save, 0.3)
    record = trainer.fit()
    split, total = record["time_split"], 3 * record["step_s"]
    assert set(split) == {"data", "forward", "backward", "optimizer", "other"}
    assert sum(split.values()) == pytest.approx(1.0)
    seconds = {k: v * total for k, v in split.items()}
    assert seconds["data"] >= 3 * 2 * 0.05 and seconds["optimizer"] >= 3 * 0.2 and seconds["other"] >= 0.3
    assert seconds["forward"] > 0 and seconds["backward"] > 0
    assert seconds["optimizer"] < 3 * 0.2 + 0.5 * total  # the sleeps are where they were put, not elsewhere
    line = [ln for ln in lines if ln.startswith("step 3/3")][0]
    assert line.startswith(progress_line(record, 3)) and f"other {split['other']:.0%} |" in line



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_the_device_work_not_its_launch():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    timer = PhaseTimer(device)
    t0 = time.perf_counter()
    timer.start()
    for _ in range(40):
        a = torch.tanh(a @ a)  # queued: the host returns long before the device is done
    timer.mark("forward")
    a.sum().item()  # the step's one sync
    wall = time.perf_counter() - t0
    seconds = timer.resolve()
    assert seconds["forward"] == pytest.approx(wall, rel=0.3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_device_work_in_clipping_is_in_opt(tmp_path, corpus, threads):
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 3, "train.log_every": 3, "train.eval_every": 0,
                                               "schedule.warmup_steps": 1, "checkpoint.every": 0,
                                               "train.device": "cuda"})
    trainer = Trainer(load_config("baseline/tiny", over), log=lambda *_: None)
    finish_grads = trainer.engine.finish_grads
    cycles = int(0.1 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # ~0.1 s of device time (kHz)

    def busy_clip(max_norm):
        torch.cuda._sleep(cycles)  # queued device work: host timers would not see it here
        return finish_grads(max_norm)

    trainer.engine.finish_grads = busy_clip
    record = trainer.fit()
    split = record["time_split"]
    assert sum(split.values()) == pytest.approx(1.0)
    assert split["optimizer"] * 3 * record["step_s"] >= 3 * 0.05
