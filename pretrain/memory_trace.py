"""PRETRAIN_MEMORY_TRACE=N: where a GPU run's peak memory went, from the CUDA allocator's own record.

`pretrain train` on CUDA with PRETRAIN_MEMORY_TRACE=N records every allocation and free of the caching
allocator, each with the Python stack that made it, from before the model is built until step N ends (or
the run stops earlier: an error, running out of memory, Ctrl-C). It then writes the record beside the
checkpoints, memory_trace.pickle (memory_trace.rank<R>.pickle on every rank of a larger run; drop it on
https://pytorch.org/memory_viz for the timeline), and says in a few log lines what the record shows: the
peak of the allocated bytes (what torch.cuda.max_memory_allocated reports), the allocation that reached it
and its stack in the project's code (which phase of the step it was), and the bytes alive at that moment
grouped by the line of the project's code that allocated them. The planner's estimate of a run is checked
against that breakdown, not only against one total.

Recording costs time (a stack per allocation), so it covers the first N steps only; the GPU suite sets
it for its warm-up steps, which it does not time. On a CPU there is no allocator record: the run is
refused in one sentence before any work.
"""
from __future__ import annotations

import os
import pickle
from collections import Counter, defaultdict

import torch

ENV = "PRETRAIN_MEMORY_TRACE"
HEADER = "memory trace"  # every line this module logs starts with it
MAX_EVENTS = 5_000_000  # the allocator keeps the latest ones past this (a ring): its total still counts
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("pretrain", "kernels", "parallel", "benchmarks"))
GIB = 2 ** 30


def steps() -> int:
    """The steps to record from PRETRAIN_MEMORY_TRACE (0: unset, none); a bad value is a ValueError, one
    sentence."""
    text = os.environ.get(ENV, "").strip()
    try:
        n = int(text or 0)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV}={text!r}: give the number of steps to record (0: none)")
    return n


def begin(device: torch.device) -> int:
    """Start recording if PRETRAIN_MEMORY_TRACE asks for it; the steps to record (0: not recording). A run
    that asks for it off CUDA is a ValueError, one sentence."""
    n = steps()
    if not n:
        return 0
    if device.type != "cuda":
        raise ValueError(f"{ENV}={n} records the CUDA caching allocator, and this run trains on the "
                         f"{device.type.upper()}; unset it")
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=MAX_EVENTS)
    return n


def finish(run_dir: str, rank: int, world: int, log, why: str) -> None:
    """Stop recording, write the record to the run directory and log what it shows. `why`: when it stopped
    (`after step 2`, `at an error in step 1`)."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    name = "memory_trace.pickle" if world == 1 else f"memory_trace.rank{rank}.pickle"
    path = os.path.join(run_dir, name)
    os.makedirs(run_dir, exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(snapshot, f)
    os.replace(path + ".tmp", path)
    device = torch.cuda.current_device()
    events = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    lines = report(events, allocated_now(snapshot, device))
    log(f"{HEADER}: recorded until {why}: {len(events):,} allocator events, written to {path} "
        "(https://pytorch.org/memory_viz draws it)")
    for line in lines:
        log(f"{HEADER}: {line}")


def allocated_now(snapshot: dict, device: int) -> int:
    """The bytes the snapshot's segments of `device` hold allocated (the allocator's allocated_bytes)."""
    return sum(b["size"] for s in snapshot["segments"] if s.get("device", device) == device
               for b in s["blocks"] if b["state"] == "active_allocated")


# -- reading a record ---------------------------------------------------------------------------
def ours(frame: dict) -> bool:
    return frame["filename"].startswith(_OURS)


def site(frames: list[dict]) -> str:
    """Where an allocation was made, in words: the innermost frame in the project's code (frames come
    innermost first), marked when a compiled graph made it; or what made it outside the project."""
    compiled = [f for f in frames if "torchinductor" in f["filename"] or f["filename"].startswith("<eval_with_key")]
    for f in frames:
        if ours(f):
            where = f"{os.path.relpath(f['filename'], ROOT)}:{f['line']} ({f['name']})"
            return f"{where}, compiled" if compiled else where
    if not frames:
        return "no Python frame (autograd's C++ backward, or a C++ caller)"
    if compiled:  # a compiled backward runs from the autograd engine: the generated code's line tells buffers apart
        f = compiled[0]
        return f"compiled code {os.path.basename(f['filename'])}:{f['line']} ({f['name']}), no project frame"
    f = frames[0]
    return f"{os.path.basename(f['filename'])}:{f['line']} ({f['name']}), outside the project's code"


def stack(frames: list[dict], depth: int = 5) -> str:
    """The project's frames of a stack, outermost first, the last `depth`."""
    mine = [f"{os.path.relpath(f['filename'], ROOT)}:{f['line']} ({f['name']})" for f in reversed(frames) if ours(f)]
    return " > ".join(mine[-depth:]) if mine else site(frames)


def _replay(events: list[dict]):
    """Allocated bytes along the events (an allocation counts until its free is requested: the allocator's
    allocated_bytes); yields (index, bytes, live blocks by address) after each event. A free of a block
    allocated before the record began (or before its ring dropped it) lowers the bytes below the traced
    ones: report() adds those blocks back as `before`."""
    live: dict[int, dict] = {}
    total = 0
    for i, e in enumerate(events):
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif action in ("free_requested", "free_completed"):
            if live.pop(e["addr"], None) is not None:
                total -= e["size"]
            elif action == "free_requested":
                total -= e["size"]  # a block from before the record: it was counted in `before`
        yield i, total, live


def report(events: list[dict], allocated_end: int, top: int = 10) -> list[str]:
    """What the record shows, as lines: the peak of the allocated bytes, the allocation that reached it,
    and the bytes alive then by the project's line that allocated them. `allocated_end`: the bytes
    allocated when the record was taken (allocated_now), which dates the blocks allocated before it began."""
    if not events:
        return ["no allocator events were recorded"]
    highest, peak_at, total = 0, -1, 0
    for i, total, _ in _replay(events):
        if total > highest:
            highest, peak_at = total, i
    before = max(allocated_end - total, 0)  # allocated before the first event, still or once
    peak = before + highest
    if peak_at < 0:
        return [f"peak {peak / GIB:,.2f} GiB allocated, all of it before the record began"]
    live = next(blocks for i, _, blocks in _replay(events) if i == peak_at)  # replayed up to the peak
    groups: dict[str, list[int]] = defaultdict(list)
    for e in live.values():
        groups[site(e.get("frames") or [])].append(e["size"])
    if before:
        groups["allocated before the record began"].append(before)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    last = events[peak_at]
    lines = [(f"peak {peak / GIB:,.2f} GiB allocated, at event {peak_at + 1:,} of {len(events):,}, reached by "
              f"{last['size'] / 2**20:,.1f} MiB from {stack(last.get('frames') or [])}"),
             "alive at the peak, by where it was allocated (GiB, share, blocks, the commonest block size):"]
    for where, sizes in ranked[:top]:
        common = Counter(sizes).most_common(1)[0][0]
        lines.append(f"  {sum(sizes) / GIB:8.2f} {sum(sizes) / peak:4.0%} {len(sizes):7,} x {common / 2**20:,.1f} MiB"
                     f"  {where}")
    rest = ranked[top:]
    if rest:
        size, n = sum(sum(s) for _, s in rest), sum(len(s) for _, s in rest)
        lines.append(f"  {size / GIB:8.2f} {size / peak:4.0%} {n:7,} blocks at {len(rest):,} other places")
    return lines
