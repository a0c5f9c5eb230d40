"""One RT layer's training forward (and forward + backward) against the batch, eager and as CUDA graphs:
the shape of spec-003 §3.7's table (d 1024, 16 heads, N 512; rt/150m-12l's layer), beside it, and the
planner's serial-loop constants refitted from the graphed forward (issue 37).

    python benchmarks/bench_rt_layer.py                          # on a GPU: batch 32 ... 2048, bf16
    python benchmarks/bench_rt_layer.py --batches 32,512 --tile triton
    python benchmarks/bench_rt_layer.py --dry-run                # CPU: tiny shapes, the emulated graph backend

The layer is RT(RTConfig(d_model, n_heads, n_layers=1, ALiBi)).blocks[0], through the op every model calls
(kernels/rt_prefill: the `tiled` path, or `triton` with --tile triton), input x [B, N, d] requiring grad,
under bf16 autocast on a GPU (fp32 on a CPU). "graphs" runs it inside captured.step("on"), so the tiled
forward and backward are replayed CUDA graphs (kernels/captured.py); the first call of each batch size
captures and is not timed. Each figure is the median of --reps calls after --warmup, the device synced
around each. The planner's constants (parallel/plan.py: seconds per serial step, kappa) are fitted to the
graphed forward at batches >= 512, as they were to the paper's table, and printed beside today's.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC_MS = {  # spec-003 §3.7 (the paper's tab:cudagraph), H100: batch -> (without, with CUDA graphs) ms per layer forward
    32: (277.08, 38.85), 64: (279.23, 42.28), 128: (279.42, 48.95), 256: (276.05, 61.39), 512: (277.33, 81.73),
    1024: (275.49, 134.09), 2048: (293.70, 240.83)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="32,64,128,256,512,1024,2048", help="comma-separated batch sizes")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512, help="N, positions per sequence")
    p.add_argument("--tile", choices=["tiled", "triton"], default="tiled", help="the rt_prefill path")
    p.add_argument("--leaf", type=int, default=1, help="the tile schedule's leaf block (1: the paper's)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--no-eager", action="store_true",
                   help="time the CUDA graphs only (the refit reads them alone; the eager rows at batches 512 and "
                        "1,024 take, by estimate, about a minute of a GPU window); --profile still profiles both")
    p.add_argument("--compile", action="store_true",
                   help="compile the pieces each position runs, as train.compile does (RT.compile); GPU only")
    p.add_argument("--profile", type=int, default=0, metavar="B",
                   help="after the table, one graphed forward and backward at batch B under torch.profiler: its "
                        "kernels by device time (where a position's time goes)")
    p.add_argument("--dry-run", action="store_true", help="CPU, d 32, 4 heads, N 16, batches 2,4: the machinery only")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from kernels import captured
    from kernels.registry import describe_paths_used
    from kernels.rt_prefill import OP, rt_prefill
    from parallel.plan import RT_TABLE_SHAPE, SERIAL_KAPPA, SERIAL_STEP_S, fit_serial_constants
    from pretrain.models.rt import RT, LayerView, RTConfig
    from pretrain.oom import is_out_of_memory

    if args.dry_run and args.compile:
        p.error("--compile needs a GPU: the dry run's emulated graph backend is a dispatch mode, which compiled "
                "code cannot run under")
    if args.dry_run:
        args.d_model, args.heads, args.seq, args.batches = 32, 4, 16, "2,4"
        captured.reset(captured.Emulated())
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --dry-run on a CPU)")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cpu" if args.dry_run else "cuda")
    cfg = RTConfig(vocab_size=256, d_model=args.d_model, n_heads=args.heads, n_layers=1, max_seq_len=args.seq,
                   leaf_block=args.leaf)
    torch.manual_seed(0)
    model = RT(cfg)
    if args.compile:
        model.compile()  # the per-position pieces; the first call of each batch size compiles them
    block = model.blocks[0].to(device)
    view = LayerView(block, None, 0)
    amp = nullcontext() if args.dry_run else torch.autocast("cuda", torch.bfloat16)
    OP.force(args.tile if args.tile != "tiled" else None, "bench_rt_layer --tile")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(x, backward):
        with amp:
            z = rt_prefill(x, view, args.leaf)
        if backward:
            z.backward(torch.ones_like(z))
        return z

    def timed(B, mode, backward) -> float:
        captured.reset()  # one batch size's graphs and buffers at a time
        x = torch.randn(B, args.seq, args.d_model, device=device, requires_grad=True)
        with captured.step(mode, log=lambda line: print("   ", line)):
            call(x, backward)  # the first call captures (graphs) and compiles Triton (triton)
            for _ in range(args.warmup):
                call(x, backward)
            times = []
            for _ in range(args.reps):
                sync()
                t0 = time.perf_counter()
                call(x, backward)
                sync()
                times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
        if mode == "on":
            held[B] = captured.summary()
        return 1e3 * statistics.median(times)

    phases = [False] if args.no_backward else [False, True]
    modes = ("on",) if args.no_eager else ("off", "on")
    rows, held = {}, {}  # held: what the graphs of each batch size hold (captured.summary)

    def measure(B):
        for mode in modes:
            for backward in phases:
                try:
                    rows[(B, mode, backward)] = timed(B, mode, backward)
                except Exception as e:  # noqa: BLE001 - out of memory (raw, or as a failed capture) ends a column
                    if not is_out_of_memory(e):
                        raise
                    rows[(B, mode, backward)] = None
                    captured.reset()
                    torch.cuda.empty_cache()
        print(f"batch {B}: " + ", ".join(f"{'graphs' if m == 'on' else 'eager'} {'fwd+bwd' if b else 'fwd'} "
                                        f"{rows[(B, m, b)]:.2f} ms" if rows[(B, m, b)] is not None else "OOM"
                                        for m in modes for b in phases), flush=True)

    def profile(B, what):
        """One forward and backward after a warm call, captured and then eager, its operators and kernels by
        self time on the device (CPU time in a dry run). Eager beside captured: the same kernels, should the
        profiler not see inside a replayed graph. The whole model's profile held about a million kernel records a
        step and ran out of time in the profiler's own post-processing (2026-11-29): one layer holds 1/12 of a
        step's."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        cuda = device.type == "cuda"
        for mode in ("on", "off"):
            captured.reset()
            x = torch.randn(B, args.seq, args.d_model, device=device, requires_grad=True)
            totals, kind = {}, "captured" if mode == "on" else "eager"
            with captured.step(mode, log=lambda *_: None):
                for backward in (False, True):  # the forward alone, for the split of the summary below
                    call(x, backward)  # captures (on)
                    call(x, backward)  # a warm call
                    sync()
                    with profiler(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
                        call(x, backward)
                        sync()
                    totals[backward] = work_items(prof.key_averages(), cuda)
            block.zero_grad(set_to_none=True)
            print(f"\n### One RT layer's forward and backward at batch {B}, {kind}, "
                  f"by {'kernel (device time)' if cuda else 'operator (CPU time: a dry run)'} ({what})\n")
            print(prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                            row_limit=20))
            print(per_position(totals[False], totals[True], args.seq, "kernels" if cuda else "operators",
                               label=f"batch {B}, {kind}"))

    def ended(*_):
        raise _Ended

    signal.signal(signal.SIGTERM, ended)  # gpu_session.sh's `timeout`: the table of the batches done so far
    done = []
    try:  # the whole loop, its first line included: a SIGTERM may come at any point of it
        print(f"measuring batches {', '.join(map(str, batches))} ({args.tile} tile) ...", flush=True)
        for B in batches:
            measure(B)
            done.append(B)
    except _Ended:
        left = batches[len(done):]  # (empty when the signal came after the last batch was measured)
        print(f"batch {left[0] if left else batches[-1]}: stopped (SIGTERM); the table has the batches measured",
              flush=True)
    batches = sorted(done)  # measured in the order given (the refit's batches first, so a timeout keeps them)
    what = f"d {args.d_model}, {args.heads} heads, N {args.seq}, leaf {args.leaf}, {args.tile} tile"
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    print(f"\n### One RT layer's forward, ms ({what}; {dev}, torch {torch.__version__})\n")
    cell = lambda v: f"{v:.2f}" if v is not None else "OOM"  # noqa: E731
    print("| batch | " + " | ".join(str(b) for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    if (args.d_model, args.heads, args.seq) == (1024, 16, 512):
        print("| paper, without CUDA graphs | " + " | ".join(f"{SPEC_MS[b][0]:.2f}" if b in SPEC_MS else "—"
                                                          for b in batches) + " |")
        print("| paper, with CUDA graphs | " + " | ".join(f"{SPEC_MS[b][1]:.2f}" if b in SPEC_MS else "—"
                                                       for b in batches) + " |")
    for mode, name in (("off", "eager"), ("on", "CUDA graphs")):
        if mode not in modes:
            continue
        for backward in phases:
            print(f"| ours, {name}{', fwd+bwd' if backward else ''} | "
                  + " | ".join(cell(rows[(b, mode, backward)]) for b in batches) + " |")
    print("\n" + "\n".join(f"- batch {b}: {text}" for b, text in sorted(held.items())) + f"\n- paths: {describe_paths_used()}")
    if args.profile:
        profile(args.profile, what)
    fit = {b: rows[(b, "on", False)] for b in batches if b >= 512 and rows[(b, "on", False)] is not None}
    if len(fit) >= 2 and not args.dry_run:
        shape = dict(d=args.d_model, f=4 * args.d_model, T=args.seq)
        step_s, kappa = fit_serial_constants("h100", fit, shape)
        print(f"\nplanner constants refitted from the graphed forward at batches {sorted(fit)}: "
              f"step {step_s * 1e6:.1f} us, kappa {kappa:.3f} (today's, from the paper's table at "
              f"{RT_TABLE_SHAPE}: {SERIAL_STEP_S * 1e6:.1f} us, {SERIAL_KAPPA:.3f})")
    return 0


def work_items(averages, cuda: bool) -> dict[str, tuple[int, float]]:
    """{name: (calls, microseconds)} of a profile's key_averages: its kernels by device time (cuda), or its aten
    operators by their own CPU time (a dry run)."""
    from torch.autograd import DeviceType

    if cuda:
        return {e.key: (e.count, e.self_device_time_total) for e in averages
                if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0}
    return {e.key: (e.count, e.self_cpu_time_total) for e in averages if e.key.startswith("aten::")}


def per_position(forward: dict, both: dict, positions: int, what: str = "kernels", top: int = 6,
                 label: str = "") -> str:
    """The profile summed and divided by the positions: microseconds and launches a position, forward and
    backward (the forward-and-backward profile less the forward's), and the largest items of each, so the
    serial loop's cost reads against its arithmetic (spec-003 §3.7: the loop's launches, not its FLOPs)."""
    backward = {k: (n - forward.get(k, (0, 0.0))[0], us - forward.get(k, (0, 0.0))[1]) for k, (n, us) in both.items()}
    lines, of = [], f" ({label})" if label else ""
    for name, items in (("forward", forward), ("backward", backward)):
        n = sum(c for c, _ in items.values())
        us = sum(t for _, t in items.values())
        big = sorted(items.items(), key=lambda kv: -kv[1][1])[:top]
        largest = "; ".join(f"{k[:60]} {t / positions:,.1f} ({c / positions:.1f}x)" for k, (c, t) in big)
        lines.append(f"- {name}{of}: {us / positions:,.1f} us and {n / positions:.1f} {what} a position "
                     f"({us / 1e3:,.1f} ms, {n:,} {what}, {positions} positions); the largest, us a position: {largest}")
    return "\n".join(lines)


class _Ended(BaseException):
    """SIGTERM: measuring stops, the table is printed. A BaseException, so that no `except Exception` on the
    way (a forced capture's, which re-raises it as a failed capture: the H200's 2026-11-29 table was lost so)
    takes it for an error of the code it interrupted."""


if __name__ == "__main__":
    sys.exit(main())
