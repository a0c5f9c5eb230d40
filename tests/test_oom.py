"""A micro batch that runs out of device memory ends in one sentence (issue 34, "Bad input"): the micro
batch, the planner's estimate for it and the largest micro batch it expects to fit (pretrain/oom.py),
exit code 2 through `pretrain train`, and nothing written after the last checkpoint. On the CPU the
OutOfMemoryError is injected and the device's memory is given (pretrain.oom.device_memory)."""
import hashlib
import os
import subprocess
import sys
import weakref
from dataclasses import replace

import fault_model
import pytest
import torch
from trainer_helpers import tiny_overrides

from pretrain import oom
from pretrain.config import load_config
from pretrain.plan import RESERVE_GIB, predict
from pretrain.run_config import ConfigError
from pretrain.runlock import LOCK_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
KEEP = "(gradient accumulation keeps the global batch)"


def _files(run_dir) -> dict:
    """Every file of the run directory (checkpoints, metrics.jsonl, config): its bytes' digest."""
    out = {}
    for root, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, run_dir)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _with_micro_batch(cfg, mb):
    return replace(cfg, train=replace(cfg.train, micro_batch_seqs=mb))


def test_an_out_of_memory_step_is_one_sentence_with_the_planners_figures_and_writes_nothing(
        tmp_path, corpus, monkeypatch):
    from pretrain.trainer import Trainer

    cfg = load_config("baseline/tiny", tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 6, "train.eval_every": 0, "checkpoint.every": 2}))  # micro batch 4 of 8
    # the planner's own answer per micro batch (pretrain plan's predict, one GPU): a device that holds 2, not 4
    planned = {mb: predict(_with_micro_batch(cfg, mb), 1, "h100").memory for mb in (1, 2, 4)}
    assert planned[1] < planned[2] < planned[4]
    capacity = int(RESERVE_GIB * 2**30 + (planned[2] + planned[4]) / 2)
    peak = 123 * 2**20
    monkeypatch.setattr(oom, "device_memory", lambda device: (capacity, peak))

    trainer = Trainer(cfg, log=lambda *a: None)
    run_dir, seen = cfg.train.run_dir, {}
    real = trainer.engine.forward_backward

    def forward_backward(*args):
        ctx = args[2]
        if ctx.step + 1 == 4:  # after step 3's metrics record; step 2's checkpoint is the last
            seen["before"] = _files(run_dir)
            held = torch.ones(1000)  # the failed step's memory: held by its frame, which the traceback keeps
            seen["held"] = weakref.ref(held)
            real(*args)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return real(*args)

    said = oom.out_of_memory_sentence

    def sentence(t, *failed):
        seen["freed_first"] = seen["held"]() is None
        return said(t, *failed)

    monkeypatch.setattr(trainer.engine, "forward_backward", forward_backward)
    monkeypatch.setattr(oom, "out_of_memory_sentence", sentence)
    with pytest.raises(oom.OutOfDeviceMemory) as info:
        trainer.fit()
    assert isinstance(info.value, ConfigError)  # the CLI's one line and exit code 2
    assert str(info.value) == (
        f"micro batch 4 × 32 tokens of baseline (run quickstart) ran out of CPU memory in step 4 "
        f"({oom.size(capacity)} device, 123.0 MiB allocated at the peak; a request for 20.0 GiB failed); the "
        f"planner estimates "
        f"{oom.size(planned[4])} for it and expects at most 2 sequences per micro batch to fit: set "
        f"train.micro_batch_seqs=2 {KEEP}")
    assert seen["freed_first"], "the failed step's tensors were alive when the sentence was computed"
    after = _files(run_dir)
    assert LOCK_NAME in seen["before"] and LOCK_NAME not in after  # the lock is released
    seen["before"].pop(LOCK_NAME)
    assert after == seen["before"]  # checkpoints, metrics.jsonl, config: not a byte after the failure
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", "step_00000002"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [int(line.split('"step": ')[1].split(",")[0]) for line in f] == [1, 2, 3]


def test_through_the_cli_an_out_of_memory_step_exits_2_with_one_line_and_no_estimate_said_so(tmp_path, corpus):
    """A compiled run of an architecture without an activation estimate: its state only, and said so."""
    over = tiny_overrides(tmp_path, corpus, **{
        "model.arch": fault_model.NAME, "model.oom_steps": "[3]", "train.compile": "true", "train.max_steps": 5,
        "train.eval_every": 0, "checkpoint.every": 1})
    env = dict(os.environ, PYTHONPATH=ROOT, FAULT_MODEL_DEVICE_GIB="80")
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "fault_model.py"), "train", "baseline/tiny", *over],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # the planner's table (parallel/plan.py, ddp: 4n + 4n + 8n + 4k) for the model's n parameters in k tensors
    with fault_model.registered(), torch.device("meta"):
        cfg = load_config("baseline/tiny", over, check_data=False)
        params = list(fault_model.SPEC.build(cfg.model).parameters())
    state = 16 * sum(p.numel() for p in params) + 4 * len(params)
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "pretrain train: error: micro batch 4 × 32 tokens of test_faults (run quickstart) ran out of CPU memory in "
        "step 3 (80.0 GiB device; a request for 20.0 GiB failed); the planner has no activation estimate for model.arch 'test_faults' and puts its "
        f"weights, gradients and optimizer state alone at {oom.size(state)} per GPU: lower train.micro_batch_seqs "
        f"to 2 or less {KEEP}"), proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert not (run_dir / LOCK_NAME).exists()
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest", "step_00000001", "step_00000002"]
    with open(run_dir / "metrics.jsonl") as f:
        assert [int(line.split('"step": ')[1].split(",")[0]) for line in f] == [1, 2]


def _cfg(**over):
    return load_config("baseline/tiny", [f"{k}={v}" for k, v in {"train.global_batch_seqs": 8,
                                                                   "train.micro_batch_seqs": 4, **over}.items()],
                       check_data=False)


def test_the_sentence_when_no_micro_batch_fits_the_estimate_is_short_or_the_planner_fails():
    cfg, cpu = _cfg(), torch.device("cpu")
    est = oom.estimate(cfg, 1)
    assert est.known and sorted(est.sizes) == [1, 2, 4, 8] and est.bytes == est.sizes[4]
    head = "micro batch 4 × 256 tokens of baseline (run quickstart) ran out of CPU memory in step 7"
    tiny = int(RESERVE_GIB * 2**30)  # nothing fits beside the reserve
    assert oom.explain(cfg, 7, cpu, 1, est, tiny) == (
        f"{head} (2.0 GiB device); the planner estimates {oom.size(est.bytes)} for it and expects no micro batch to "
        f"fit (1 sequence: {oom.size(est.sizes[1])}): turn on parallel.recompute or split the model over more GPUs "
        "(pretrain plan CONFIG --gpus N proposes a layout)")
    assert oom.explain(cfg, 7, cpu, 1, est, 80 * 2**30) == (
        f"{head} (80.0 GiB device); the planner estimates {oom.size(est.bytes)} for it, which it expected to fit "
        f"(its estimate is short here): lower train.micro_batch_seqs to 2 or less {KEEP}")
    assert oom.explain(cfg, 7, cpu, 1, None, None, why_no_estimate="RuntimeError: no") == (
        f"{head}; the planner's estimate could not be made (RuntimeError: no): lower train.micro_batch_seqs to 2 "
        f"or less {KEEP}")
    one = _cfg(**{"train.micro_batch_seqs": 1})
    assert oom.explain(one, 7, cpu, 1, oom.estimate(one, 1), 80 * 2**30).endswith(
        "which it expected to fit, and no smaller micro batch exists: turn on parallel.recompute or split the model "
        "over more GPUs (pretrain plan CONFIG --gpus N proposes a layout)")


def test_the_sentence_names_the_failed_request_and_says_when_fragmentation_kept_it_from_fitting():
    """torch's CUDA message (its wording since torch 2.2) gives the request, the device's free memory and
    what the caching allocator holds unused; fragmentation is named only when those two add up to the request."""
    def message(request, free, loose):
        return (f"CUDA out of memory. Tried to allocate {request}. GPU 0 has a total capacity of 139.81 GiB of which "
                f"{free} is free. Including non-PyTorch memory, this process has 139.2 GiB memory in use. Of the "
                f"allocated memory 101.3 GiB is allocated by PyTorch, and {loose} is reserved by PyTorch but "
                "unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")

    fragmented = torch.OutOfMemoryError(message("12.50 GiB", "602.00 MiB", "37.88 GiB"))
    try:
        try:
            raise fragmented
        except RuntimeError as e:
            raise RuntimeError("backend compiler failed") from e
    except RuntimeError as wrapped:
        assert oom.failed_request(wrapped) == {"request": int(12.5 * 2**30), "free": 602 * 2**20,
                                               "unallocated": int(37.88 * 2**30)}
    full = oom.failed_request(torch.OutOfMemoryError(message("12.50 GiB", "602.00 MiB", "11.00 GiB")))
    assert oom.failed_request(RuntimeError("CUDA out of memory.")) == {}
    cfg, gpu = _cfg(), torch.device("cuda")
    est = oom.estimate(cfg, 1)
    head = "micro batch 4 × 256 tokens of baseline (run quickstart) ran out of GPU memory in step 2"
    said = oom.explain(cfg, 2, gpu, 1, est, 80 * 2**30, 2**30, failed=oom.failed_request(fragmented))
    assert said.startswith(
        f"{head} (80.0 GiB device, 1.0 GiB allocated at the peak; a request for 12.5 GiB failed with 37.9 GiB reserved "
        "but unallocated (fragmented: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may let it fit)); the "
        "planner estimates"), said
    said = oom.explain(cfg, 2, gpu, 1, est, 80 * 2**30, 2**30, failed=full)
    assert said.startswith(f"{head} (80.0 GiB device, 1.0 GiB allocated at the peak; a request for 12.5 GiB "
                           "failed); the planner estimates"), said
    assert oom.explain(cfg, 2, gpu, 1, None, None, why_no_estimate="E", failed=full).startswith(
        f"{head} (a request for 12.5 GiB failed); the planner's estimate could not be made (E)")


def test_an_architecture_without_an_estimate_whose_state_alone_does_not_fit():
    with fault_model.registered():
        cfg = _cfg(**{"model.arch": fault_model.NAME})
        est = oom.estimate(cfg, 1)
        assert not est.known
        said = oom.explain(cfg, 1, torch.device("cuda"), 1, est, est.bytes)  # 2 GiB reserve: never fits
    assert said == (
        f"micro batch 4 × 256 tokens of test_faults (run quickstart) ran out of GPU memory in step 1 "
        f"({oom.size(est.bytes)} device); the planner has no activation estimate for model.arch 'test_faults' and "
        f"puts its weights, gradients and optimizer state alone at {oom.size(est.bytes)} per GPU, which do not fit: "
        "split the model over more GPUs (pretrain plan CONFIG --gpus N proposes a layout)")


def test_out_of_memory_is_found_inside_wrappers_and_other_errors_pass_unchanged():
    error = torch.cuda.OutOfMemoryError("CUDA out of memory.")
    assert oom.is_out_of_memory(error)
    try:
        try:
            raise error
        except RuntimeError as e:
            raise RuntimeError("backend compiler failed") from e  # as dynamo and inductor wrap it
    except RuntimeError as wrapped:
        assert oom.is_out_of_memory(wrapped)
    assert not oom.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))

    class Trainer:  # what the guard reads, for a failure it does not handle
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="^other$"), oom.step_memory_guard(Trainer()):
        raise ValueError("other")


def test_the_planner_stages_of_a_process_with_a_process_group_come_from_a_child():
    """A run holding a process group (several ranks, or megatron-core's one-rank group) asks a child
    process for the dry run; its stages are the in-process ones."""
    from pretrain.plan import rank_stages

    cfg = _cfg()
    mine = rank_stages(cfg, 1)
    theirs = oom._stages_in_child(cfg, 1)
    assert [(r.stage, r.units, r.params, r.tensors, r.act_fraction) for r in theirs] == \
        [(r.stage, r.units, r.params, r.tensors, r.act_fraction) for r in mine]
