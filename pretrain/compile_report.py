"""Where a compiled run's first step went, in one log line: torch.compile's own phase timers and the kernel
registry's measurements.

    compile: 61.2 s by step 1: dynamo 9.8 s (of it measuring kernel paths 6.1 s), the forward 31.0 s,
    the backward 20.4 s; waiting for parallel Triton and C++ builds 18.2 s of those two

A compiled run's first step can take a minute or more on a GPU, and the progress line shows only that it
was slow. The phases come from dynamo's timers (torch._dynamo.utils.compilation_time_metrics: seconds per
timed function, private and named differently between torch releases, so read defensively: a phase
whose timer is missing is left out, and with none the line is not written). "dynamo" is the frames'
compile less the backend's (tracing, guards; the kernel registry measures its paths here, at trace time);
"the forward" is the backend compile of the forward graphs (AOT autograd's joint graph and inductor); "the
backward" is inductor's compile of the backward graphs, at the first backward.
"""
from __future__ import annotations

# (phase, dynamo's timer names, the first that exists counts)
_TIMERS = {
    "frames": ("_compile.compile_inner",),
    "backend": ("OutputGraph.call_user_compiler",),
    "backward": ("backward._backward_impl", "compile_fx.<locals>.bw_compiler"),
    "wait": ("async_compile.wait",),
}


def snapshot() -> dict[str, float]:
    """Seconds spent so far in each phase dynamo times (missing timers left out)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except Exception:  # noqa: BLE001 - a torch without it: no line
        return {}
    out = {}
    for phase, names in _TIMERS.items():
        for name in names:
            if name in metrics:
                out[phase] = float(sum(metrics[name]))
                break
    return out


def measured_seconds() -> float:
    """Seconds the kernel registry spent measuring paths in this process (kept choices cost none)."""
    from kernels import registry

    return sum(c.took_s for cs in registry.choices().values() for c in cs if not c.kept)


def line(step: int, before: dict[str, float], measuring_before: float = 0.0) -> str | None:
    """The compile line for what happened since `before` (snapshot()) and `measuring_before`
    (measured_seconds()), up to `step`; None when dynamo timed nothing (an eager run, or a torch without
    the timers)."""
    now = snapshot()
    spent = {phase: now[phase] - before.get(phase, 0.0) for phase in now}
    frames, backend, backward = spent.get("frames", 0.0), spent.get("backend"), spent.get("backward", 0.0)
    if frames + backward < 0.05:
        return None
    measuring = measured_seconds() - measuring_before
    parts = []
    if backend is not None:
        text = f"dynamo {frames - backend:.1f} s"
        if measuring >= 0.05:
            text += f" (of it measuring kernel paths {measuring:.1f} s)"
        parts.append(text)
        parts.append(f"the forward {backend:.1f} s")
    else:
        parts.append(f"dynamo and the forward {frames:.1f} s")
    if "backward" in spent:
        parts.append(f"the backward {backward:.1f} s")
    text = f"compile: {frames + backward:.1f} s by step {step}: " + ", ".join(parts)
    if spent.get("wait", 0.0) >= 0.05:
        text += f"; waiting for parallel Triton and C++ builds {spent['wait']:.1f} s of those"
    return text
