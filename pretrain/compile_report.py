"""Where a compiled run's compile time went, in one log line beside its first progress line: torch.compile's
own phase timers and the kernel registry's measurements.

    compile: 61.2 s by step 1: dynamo 9.8 s (of it measuring kernel paths 6.1 s), the forward 31.0 s, the
    backward 20.4 s; waiting for parallel Triton and C++ builds 18.2 s of those

A compiled run's first step can take a minute or more on a GPU, and the progress line shows only that it
was slow. The phases come from dynamo's timers (torch._dynamo.utils.compilation_time_metrics: seconds per
timed function, private and named alike in torch 2.11 and 2.13, read defensively: a phase whose timer is
missing is left out, and with none the line is not written):
- "dynamo": the frames' compile (_compile.compile_inner) less the backend's: tracing and guards, and the
  kernel registry's measured choices, which are made at trace time (kernels/registry.py);
- "the forward": the backend's compile of the traced graphs (OutputGraph.call_user_compiler: AOT
  autograd and inductor; it holds the backward's too where that is compiled with the forward, as with
  dynamic shapes or a cached graph);
- "the backward": inductor's compile of a backward graph at its first backward (backward._backward_impl).
A measured candidate that is compiled itself (FlexAttention) adds entries to the same timers while the
frame around it is timed; the registry notes those (registry.nested_compile_s) and they are taken out, so
its compile is counted once, inside the measuring. Measuring outside any trace (an eager call) is said
apart, not as compile time.
"""
from __future__ import annotations

_TIMERS = {"frames": "_compile.compile_inner", "backend": "OutputGraph.call_user_compiler",
           "backward": "backward._backward_impl", "wait": "async_compile.wait"}


def snapshot() -> dict[str, float]:
    """Seconds spent so far in each phase dynamo times, nested measurements' compiles taken out (missing
    timers left out)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except Exception:  # noqa: BLE001 - a torch without it: no line
        return {}
    from kernels.registry import nested_compile_s

    return {phase: float(sum(metrics[name])) - nested_compile_s.get(name, 0.0)
            for phase, name in _TIMERS.items() if name in metrics}


def measured_seconds() -> tuple[float, float]:
    """Seconds the kernel registry spent measuring paths in this process (kept choices cost none): (inside
    a trace, outside any)."""
    from kernels import registry

    made = [c for cs in registry.choices().values() for c in cs if not c.kept]
    return sum(c.took_s for c in made if c.traced), sum(c.took_s for c in made if not c.traced)


def line(step: int, before: dict[str, float], measuring_before: tuple[float, float] = (0.0, 0.0)) -> str | None:
    """The compile line for what happened since `before` (snapshot()) and `measuring_before`
    (measured_seconds()), up to `step`; None when dynamo timed nothing (an eager run, or a torch without
    the timers)."""
    now = snapshot()
    spent = {phase: now[phase] - before.get(phase, 0.0) for phase in now}
    frames, backend, backward = spent.get("frames", 0.0), spent.get("backend"), spent.get("backward", 0.0)
    if frames + backward < 0.05:
        return None
    traced, eager = (now_ - then for now_, then in zip(measured_seconds(), measuring_before))
    measuring = f" (of it measuring kernel paths {traced:.1f} s)" if traced >= 0.05 else ""
    if backend is not None:
        parts = [f"dynamo {frames - backend:.1f} s{measuring}", f"the forward {backend:.1f} s"]
    else:
        parts = [f"dynamo and the forward {frames:.1f} s{measuring}"]
    if "backward" in spent:
        parts.append(f"the backward {backward:.1f} s")
    text = f"compile: {frames + backward:.1f} s by step {step}: " + ", ".join(parts)
    if spent.get("wait", 0.0) >= 0.05:
        text += f"; waiting for parallel Triton and C++ builds {spent['wait']:.1f} s of those"
    if eager >= 0.05:
        text += f"; measuring kernel paths outside the compile {eager:.1f} s more"
    return text
