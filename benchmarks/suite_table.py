"""The GPU suite's table (benchmarks/gpu_suite.py): one line per run, and the issues' targets as ratios of
the figures measured in the same run."""
from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# -- the table --------------------------------------------------------------------------------------
def table(results: list[dict]) -> str:
    lines = ["| run | micro × T | tokens/s | TFLOP/s | MFU | peak GiB | planner GiB | compile s | fwd/bwd/opt/data/other | "
             "attention | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        num = lambda k, f: (f.format(r[k]) if r.get(k) is not None else "—")  # noqa: E731
        split = r.get("time_split") or {}
        order = ("forward", "backward", "optimizer", "data", "other")
        split_s = "/".join(f"{100 * split[k]:.0f}" for k in order if k in split) or "—"
        status = r.get("status", "") + (f": {r['error']}" if r.get("error") else "")
        name = r["row"] + ("" if r.get("compiled", True) else " (eager)")
        lines.append(f"| {name} | {r.get('micro', '—')} × {r.get('seq_len', '—')} | {num('tokens_per_s', '{:,.0f}')} | "
                     f"{num('tflops', '{:.1f}')} | {num('mfu', '{:.1%}')} | {num('memory_gb', '{:.1f}')} | {num('planner_gib', '{:.1f}')} | "
                     f"{compile_cell(r)} | {split_s} | {r.get('paths') or '—'} | {status} |")
    notes = [f"- {r['row']}: {r['note']}" for r in results if r.get("note")]
    notes += [f"- {r['row']} compile: {r['compile_phases']}" for r in results if r.get("compile_phases")]
    for r in results:  # PRETRAIN_MEMORY_TRACE's reading of the allocator's record, as the run logged it
        if r.get("memory_trace"):
            notes += [f"- {r['row']} memory (the allocator's record of its warm-up steps):", "", "  ```",
                      *(f"  {line}" for line in r["memory_trace"]), "  ```"]
    return "\n".join(lines + ([""] + notes if notes else []))


def compile_cell(r: dict) -> str:
    """The run's compile seconds; after a warm-up, that first compile's / the timed run's from its caches."""
    timed = f"{r['compile_s']:.0f}" if r.get("compile_s") is not None else "—"
    return f"{r['warm_compile_s']:.0f} / {timed}" if r.get("warm_compile_s") is not None else timed


def ratios(results: list[dict]) -> list[str]:
    """The issue's targets as ratios measured in this run."""
    by = {r["row"]: r for r in results if r.get("tokens_per_s") and not r.get("zero_grads")}
    for r in results:  # a row run again with expandable segments stands for it in the ratios
        if r.get("retry_of") and r.get("tokens_per_s") and not r.get("zero_grads"):
            by.setdefault(r["retry_of"], r)
    out = []

    def per_token(name):
        return 1 / by[name]["tokens_per_s"] if name in by else None

    hf = next((r for r in results if r["row"].startswith("HF Llama") and r.get("tokens_per_s")), None)
    if hf and "baseline/s no-mask" in by:
        out.append(f"- baseline/s no-mask / HF Llama tokens/s: {by['baseline/s no-mask']['tokens_per_s'] / hf['tokens_per_s']:.2f}x (target ≥ 1.15x)")
    if "baseline/m no-mask" in by:
        out.append(f"- baseline/m MFU: {by['baseline/m no-mask']['mfu']:.1%} (target ≥ 40 %)")
    if "baseline/s" in by and "baseline/s sdpa" in by:
        out.append(f"- baseline/s automatic attention / SDPA with the dense mask, tokens/s: "
                   f"{by['baseline/s']['tokens_per_s'] / by['baseline/s sdpa']['tokens_per_s']:.2f}x (target ≥ 1x)")
    if "sps/s" in by and "baseline/s" in by:
        out.append(f"- sps/s time per input token / baseline/s: {per_token('sps/s') / per_token('baseline/s'):.2f}x (target ≤ 1.8x)")
    for a, b in (("cart/d1024-r6", "cart/dense-7l"), ("crt/owt-crt-d5-c1024", "crt/owt-roformer-n12-c1024")):
        if a in by and b in by:  # time per FLOP of a against b's: TFLOP/s of b over a's
            out.append(f"- {a} time per FLOP / {b}'s: {by[b]['tflops'] / by[a]['tflops']:.2f}x (target ≤ 1.1x)")
    for blocks, whole in (("baseline/s no-mask blocks", "baseline/s no-mask"), ("baseline/s blocks", "baseline/s")):
        if blocks in by and whole in by:  # train.compile_scope=blocks against whole-model compile
            out.append(f"- {blocks} / whole-model compile: tokens/s {by[blocks]['tokens_per_s'] / by[whole]['tokens_per_s']:.2f}x, "
                       f"compile {by[blocks]['compile_s']:.0f} s against {by[whole]['compile_s']:.0f} s")
    for name, target in (("rt/300m-12l graphs b512", "≥ 42k, aim 55k"), ("gpn/gpn-m-130m graphs b128", "≥ 40k, aim 80k")):
        if name in by:
            out.append(f"- {name}: {by[name]['tokens_per_s']:,.0f} tokens/s (target {target})")
    for graphed, eager in (("rt/300m-12l graphs", "rt/300m-12l"), ("gpn/gpn-m-130m graphs", "gpn/gpn-m-130m")):
        if graphed in by and eager in by:
            out.append(f"- {graphed} / eager, same batch: {per_token(eager) / per_token(graphed):.2f}x")
    if "rt/300m-12l graphs b512 triton" in by and "rt/300m-12l graphs b512" in by:
        out.append(f"- RT Triton tile / PyTorch tile tokens/s: {by['rt/300m-12l graphs b512 triton']['tokens_per_s'] / by['rt/300m-12l graphs b512']['tokens_per_s']:.2f}x")
    if "rt/300m-12l graphs b512" in by and "rt/t-300m-12l" in by:
        out.append(f"- RT / Transformer time per token: {per_token('rt/300m-12l graphs b512') / per_token('rt/t-300m-12l'):.2f}x "
                   "(the paper's 3.1x; aim below 3x)")
    return out


def header(args) -> str:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "CPU (dry run)"
    try:
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                               text=True).stdout.strip() or "unknown"
    except OSError:  # no git on the machine: COMMIT= names it
        commit = "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"### gpu_suite --part {args.part}: {device}, torch {torch.__version__}, Triton {triton_version}, "
            f"commit {commit}, {when}\n\n{args.warmup} warm-up steps, then the median of {args.steps}; "
            f"cap {args.cap:.0f} s per run{getattr(args, 'caps_note', '')}; {args.cache_state}"
            f"{getattr(args, 'warm_note', '')}.")
