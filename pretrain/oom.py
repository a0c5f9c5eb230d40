"""A training step that runs out of device memory ends in one sentence, with the planner's figures.

    with step_memory_guard(trainer):   # around each optimizer step (pretrain/trainer.py)
        trainer._optimizer_step(...)

When the step (any micro batch's forward or backward, finish_grads, the optimizer step; the first,
compiled step included) raises torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same
class; inductor and dynamo may wrap it, so the exception's chain is searched), the guard drops the
failed step's memory (the traceback's frames hold its activations and micro batches: they are
cleared) and raises OutOfDeviceMemory, a ConfigError: `pretrain train` prints it as one line,
`pretrain train: error: ...`, and exits with 2. Its sentence names the micro batch, the step, the
device's memory, the planner's estimate for this run's micro batch and layout (pretrain/plan.py:
rank_stages, rank_bytes, fits: the figures `pretrain plan CONFIG --gpus N --gpu-memory GIB` shows)
and the largest micro batch the planner expects to fit. The size of the allocation that failed comes
from torch's message, and where the allocator held enough memory unused but not in one piece, the
sentence says so and names PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. An architecture without an activation_bytes
estimate in its registry entry gets its weights, gradients and optimizer state only, and says so.

Nothing is written on this path: the trainer saves only after a step completes (the failed step's
checkpoint and metrics record are never made) and its `finally` only closes; the run lock is
released by fit's `hold_run_dir`.
"""
from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch

from pretrain.run_config import ConfigError

OOM_ERRORS = tuple({c for c in (getattr(torch, "OutOfMemoryError", None),
                                getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if c is not None})


class OutOfDeviceMemory(ConfigError):
    """A micro batch too large for the device, in one sentence with the planner's figures."""


def _chain(error: BaseException):
    """`error` and every exception it wraps (its cause, its context, a compiler's inner_exception), each once."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error`, or an exception it wraps, is torch's OutOfMemoryError."""
    return any(isinstance(e, OOM_ERRORS) for e in _chain(error))


_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([0-9.]+) (bytes|KiB|MiB|GiB|TiB)"
# the figures of torch's CUDA allocator message ("Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
# 79.1 GiB of which 1.2 GiB is free. ... and 6.6 GiB is reserved by PyTorch but unallocated. ...")
_FIGURES = {"request": "Tried to allocate " + _SIZE, "free": "of which " + _SIZE + " is free",
            "unallocated": _SIZE + " is reserved by PyTorch but unallocated"}


FRAGMENTED = "fragmented: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may let it fit"  # the GPU suite reads it


def failed_request(error: BaseException) -> dict:
    """What torch's out-of-memory message in `error`'s chain says of the failed allocation, in bytes:
    `request` (what it asked for), `free` (the device's free memory), `unallocated` (reserved by the
    caching allocator but not in use); each only where the message says it."""
    out = {}
    for e in _chain(error):
        for key, pattern in _FIGURES.items():
            found = key not in out and re.search(pattern, str(e))
            if found:
                out[key] = int(float(found.group(1)) * _UNITS[found.group(2)])
    return out


def _drop_frames(error: BaseException) -> None:
    """Clear the locals of every finished frame in the tracebacks of `error` and what it wraps (the failed
    step's activations, loss and micro batches), so that the memory is free before anything else runs."""
    for e in list(_chain(error)):  # the whole chain first: clearing a traceback does not change the links
        traceback.clear_frames(e.__traceback__)  # a frame still running (the trainer's loop) is left alone
        e.__traceback__ = None


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(total bytes, bytes allocated at the peak so far) of a CUDA device; (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.get_device_properties(device).total_memory, torch.cuda.max_memory_allocated(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the planner's figures ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    micro_batch: int
    bytes: int  # the fullest rank at this micro batch: state, plus activations when `known`
    known: bool  # the architecture has an activation_bytes estimate
    sizes: dict  # every micro batch the per-rank batch allows: its bytes

    def largest_fitting(self, capacity: float | None) -> int | None:
        """The largest micro batch whose estimate fits `capacity` bytes (0: none; None: not known)."""
        if capacity is None or not self.known:
            return None
        from pretrain.plan import fits

        return max((mb for mb, b in self.sizes.items() if fits(b, capacity)), default=0)


def estimate(cfg, dp: int, stages=None) -> Estimate:
    """The planner's bytes for cfg's layout at its micro batch and at every other one it could use.
    `stages`: pretrain.plan.rank_stages(cfg, dp) when already known."""
    from pretrain.models import get_arch
    from pretrain.plan import micro_batch_options, rank_bytes

    spec = get_arch(cfg.model.arch)
    stages = stages if stages is not None else planner_stages(cfg, dp)
    sizes, known = {}, True
    for mb in sorted({*micro_batch_options(cfg, dp), cfg.train.micro_batch_seqs}):
        sizes[mb], known = rank_bytes(cfg, spec, stages, cfg.parallel, dp, mb)
    return Estimate(cfg.train.micro_batch_seqs, sizes[cfg.train.micro_batch_seqs], known, sizes)


def planner_stages(cfg, dp: int):
    """pretrain.plan.rank_stages in this process when it holds no process group (one rank without
    megatron-core), else in a child process: the dry run takes torch's fake process group."""
    import torch.distributed as dist

    from pretrain.plan import rank_stages

    if not (dist.is_available() and dist.is_initialized()):
        return rank_stages(cfg, dp)
    return _stages_in_child(cfg, dp)


def _stages_in_child(cfg, dp: int, timeout_s: float = 300.0):
    from pretrain.config import to_yaml
    from pretrain.plan import StageReport

    with tempfile.TemporaryDirectory(prefix="oom-plan-") as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            f.write(to_yaml(cfg))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # the child is no rank of this job
        out = subprocess.run([sys.executable, "-m", "pretrain.oom", path, str(dp)], capture_output=True, text=True,
                             env=env, timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1])
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return [StageReport(r["stage"], tuple(r["units"]), r["params"], r["tensors"], (), None,
                        act_fraction=r["act_fraction"]) for r in rows]


def _child_main(argv: list[str]) -> int:
    from pretrain.config import load_config
    from pretrain.plan import rank_stages

    cfg = load_config(argv[0], check_data=False, log=lambda *_: None)
    rows = [{"stage": r.stage, "units": list(r.units), "params": r.params, "tensors": r.tensors,
             "act_fraction": r.act_fraction} for r in rank_stages(cfg, int(argv[1]))]
    print(json.dumps(rows))
    return 0


# -- the sentence ------------------------------------------------------------------------------------
def size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _no_micro_batch_helps(cfg, activations: bool = True) -> str:
    """What to do when no micro batch fits (recompute helps only where activations are part of it)."""
    from pretrain.models import get_arch

    recompute = activations and cfg.parallel.recompute == "none" and get_arch(cfg.model.arch).recompute_policies()
    return (("turn on parallel.recompute or " if recompute else "") +
            "split the model over more GPUs (pretrain plan CONFIG --gpus N proposes a layout)")


def _request_clause(failed: dict) -> str:
    """The failed allocation, and fragmentation where the allocator held enough memory but not in one piece."""
    if "request" not in failed:
        return ""
    said = f"a request for {size(failed['request'])} failed"
    loose = failed.get("unallocated", 0)
    if loose and loose + failed.get("free", 0) >= failed["request"]:
        said += f" with {size(loose)} reserved but unallocated ({FRAGMENTED})"
    return said


def explain(cfg, step: int, device: torch.device, dp: int, est: Estimate | None, capacity: int | None = None,
            peak: int | None = None, why_no_estimate: str = "", failed: dict | None = None) -> str:
    """The one sentence: `est` None when the planner could not be asked (`why_no_estimate` says why);
    `failed`: failed_request's figures of torch's message."""
    from pretrain.plan import fits, micro_batch_options

    mb, T = cfg.train.micro_batch_seqs, cfg.data.seq_len
    kind = "GPU" if device.type == "cuda" else device.type.upper()
    parts = [_request_clause(failed or {})]
    if capacity is not None:
        at_peak = f", {size(peak)} allocated at the peak" if peak is not None else ""
        parts.insert(0, f"{size(capacity)} device{at_peak}")
    held = f" ({'; '.join(p for p in parts if p)})" if any(parts) else ""
    head = (f"micro batch {mb} × {T} tokens of {cfg.model.arch} (run {cfg.train.name}) ran out of {kind} memory "
            f"in step {step}{held}")
    keep = "(gradient accumulation keeps the global batch)"
    smaller = [k for k in micro_batch_options(cfg, dp) if k < mb]
    lower = f"lower train.micro_batch_seqs{f' to {smaller[-1]} or less' if smaller else ''} {keep}"
    if est is None:
        return f"{head}; the planner's estimate could not be made ({why_no_estimate}): {lower}"
    if not est.known:
        said = (f"{head}; the planner has no activation estimate for model.arch {cfg.model.arch!r} and puts its "
                f"weights, gradients and optimizer state alone at {size(est.bytes)} per GPU")
        if capacity is not None and not fits(est.bytes, capacity):
            return f"{said}, which do not fit: {_no_micro_batch_helps(cfg, activations=False)}"
        return f"{said}: {lower}"
    said = f"{head}; the planner estimates {size(est.bytes)} for it"
    largest = est.largest_fitting(capacity)
    if largest is None:  # the device's memory is not known
        return f"{said}: {lower}"
    if largest == 0:
        return (f"{said} and expects no micro batch to fit (1 sequence: {size(est.sizes[1])}): "
                f"{_no_micro_batch_helps(cfg)}")
    if largest >= mb:  # the estimate is short of what the step took
        if not smaller:
            return f"{said}, which it expected to fit, and no smaller micro batch exists: {_no_micro_batch_helps(cfg)}"
        return f"{said}, which it expected to fit (its estimate is short here): {lower}"
    return (f"{said} and expects at most {largest} sequences per micro batch to fit: set "
            f"train.micro_batch_seqs={largest} {keep}")


def out_of_memory_sentence(trainer, failed: dict | None = None) -> str:
    """The sentence for `trainer`'s failed step (its step counter not yet advanced); `failed`: what torch's
    message said of the failed allocation (failed_request)."""
    cfg, device = trainer.cfg, trainer.device
    capacity, peak = device_memory(device)
    try:
        est, why = estimate(cfg, trainer.layout.dp), ""
    except Exception as e:  # noqa: BLE001  (the sentence is said whatever the planner does)
        est, why = None, f"{type(e).__name__}: {e}"
    return explain(cfg, trainer.step + 1, device, trainer.layout.dp, est, capacity, peak, why, failed)


class step_memory_guard:  # lower case: used as a context manager, like contextlib's
    """Around one training step: torch's OutOfMemoryError becomes OutOfDeviceMemory (see the module's
    docstring); any other exception passes unchanged."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or not isinstance(error, Exception) or not is_out_of_memory(error):
            return False
        del tb
        failed = failed_request(error)
        _drop_frames(error)
        free_device_memory(self.trainer.device)
        raise OutOfDeviceMemory(out_of_memory_sentence(self.trainer, failed)) from None


if __name__ == "__main__":  # the planner's stages for a config, as JSON (planner_stages' child process)
    sys.exit(_child_main(sys.argv[1:]))
