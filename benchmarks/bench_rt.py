"""The Recurrent Transformer layer (spec-003) on this machine: the tiled schedule with its custom backward
(kernels/rt_prefill/tiled.py) against autograd through the naive token-by-token loop (reference.py),
one layer at a time, side by side; and what tensor parallelism would add to it.

    PYTHONPATH=. python benchmarks/bench_rt.py                  # all five sections (~2-4 min on 2 busy cores)
    PYTHONPATH=. python benchmarks/bench_rt.py time --profile   # also torch.profiler tables of both backwards
    PYTHONPATH=. python benchmarks/bench_rt.py memory tp        # just these sections
    PYTHONPATH=. python benchmarks/bench_rt.py --quick          # a smoke run: small N, one round (~1 min)

The layer: RT(RTConfig(d_model=--d-model, n_heads=--heads, n_layers=1, ALiBi, no RoPE)).blocks[0] seen
through LayerView (what the kernels take), input x [--batch, N, d] ~ N(0, 1), fp32, eager,
--threads torch threads (default 1: with 2 threads on 2 cores that another process also uses, OpenMP's
spinning workers made the layer 100-300x slower here; each tp rank also runs 1 thread).

keys: the persistent key rows the tiled forward loads, counted by tiled.KEYS_MOVED during a real
forward (no grad, batch 1: the count does not depend on the batch) at each N of --key-seqs, leaf 1
(the paper's Algorithm 1) and leaf 16 (spec §3.8's leaf blocks: tiles with P < 16 replaced by direct
reads of the query's own leaf), beside schedule.keys_moved(N) and the naive loop's N (N - 1) / 2.

memory: one forward + backward of the layer at each N of --mem-seqs, tiled vs naive, each in a fresh
process under glibc malloc (MALLOC_ARENA_MAX=1, nothing preloaded, so RSS follows use). A tiny step
first allocates the parameter gradients and warms the libraries; the peak is VmHWM after the step
(reset to the current RSS just before it through /proc/self/clear_refs where the kernel allows, so
import-time peaks cannot hide it) minus VmRSS before it. Per doubling of N the tiled path (X, Z, the
log-sum-exp and O(N) recomputed tensors) should grow ~2x; autograd through the naive loop keeps every
step's concatenated keys and values, sum_i i rows = N^2/2, so ~4x. (The tiled path's tile functions
hold at most tiled.BLOCK queries' scores at a time; "top tile MB" is what the last tile's whole
[B, H, N/2, N/2] score matrix would take: before they were blocked, it made the path grow ~3.4x per
doubling from N ~ 1024 at d=64, H=4.)

time: at N = --seq, forward and backward timed apart (z = f(x); then z.backward(g) alone), gradients of x
and of every block parameter, both paths; one warm-up step each, then --rounds rounds alternating the
order; medians, and the median over rounds of naive / tiled in the same round (the RATIO lines). Where
the layer has hand-written input gradients (LayerView.vjp_kv / vjp_post, used by the backward's
sequential phase), a third path "tiled/autograd" hides them, so the backward falls back to
torch.autograd.grad on a one-position graph per position: their gain, measured the same way.
Then one instrumented tiled backward per variant split by phase (spec §3.5: 0 parallel recompute of A
from the log-sum-exp, 1 the reverse loop over positions, 2 the queries' gradient and the batched VJPs), phase 1
further into kv's and post's input gradients at each position, the tile gradients and the rest.
--profile adds torch.profiler tables (self CPU time per op) of the tiled and the naive backward.

traffic: spec §3.4's model of GPU HBM traffic: the naive loop loads N (N - 1) / 2 key rows (step i
reads all i earlier ones for one query), the tiled schedule (N/2) log2 N; their ratio is the predicted
gain in key/value traffic, and so in time where the kernel is memory-bound. On this CPU both paths do
the same attention FLOPs in N sequential steps, so the CPU times above are not that gain.

tp: tensor parallelism over 2 ranks would put 2 all-reduces of a [B, d] activation in every position's
step of every layer (row-parallel W_O and W_2 inside the recurrence: spec §3.8), 2N per layer forward
(the backward's reverse loop needs as many again). Two gloo processes on this machine
(tests/distributed.py's run_ranks: tcp on 127.0.0.1, 1 thread each) time 2N all-reduces of a float32
[B, d] tensor, for d = --tp-width and d = --d-model, --tp-rounds times (the slower rank per round,
median), and the same bytes in one all-reduce (bandwidth vs per-call latency). Beside it: one
process's forward + backward of the layer (the tiled path, as training runs it) at that d, B and
N = --tp-seq, and the all-reduces' share of it. Loopback gloo on a CPU is not NVLink NCCL on a GPU
(~10-30 us per small all-reduce there, but the layer's step is also ~100x shorter): the per-call
latency against the per-position work is the point.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/distributed.py: run_ranks

import torch  # noqa: E402

import sections  # noqa: E402  (benchmarks/)
from bench_sps import load, rounds_of  # noqa: E402  (benchmarks/)
from procmem import fresh_env, reset_peak, status_kib  # noqa: E402  (benchmarks/)
from kernels.rt_prefill import reference, schedule, tiled  # noqa: E402
from pretrain.models.rt import RT, LayerView, RTConfig  # noqa: E402

PATHS = {"tiled": tiled.prefill, "naive": reference.prefill}
SECTIONS = ("keys", "memory", "time", "traffic", "tp")


# -- the layer --------------------------------------------------------------------------------------
def layer(d: int, heads: int, N: int, seed: int = 0) -> LayerView:
    """One RT layer (ALiBi, no RoPE) as the kernels see it; its block's parameters require grad."""
    torch.manual_seed(seed)
    model = RT(RTConfig(vocab_size=64, d_model=d, n_layers=1, n_heads=heads, max_seq_len=max(N, 8)))
    return LayerView(model.blocks[0], None, 0)


def inputs(B: int, N: int, d: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [B, N, d] requiring grad, the upstream gradient g), fixed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, d, generator=gen).requires_grad_()
    return x, torch.randn(B, N, d, generator=gen)


def zero_grads(x, view) -> None:
    x.grad = None
    for p in view.parameters():
        p.grad = None


def step(f, x, g, view) -> tuple[float, float]:
    """(forward s, backward s) of one forward + backward by f (x, view) -> z; gradients of x and every
    block parameter."""
    zero_grads(x, view)
    t0 = time.perf_counter()
    z = f(x, view)
    t1 = time.perf_counter()
    z.backward(g)
    return t1 - t0, time.perf_counter() - t1


# -- keys -------------------------------------------------------------------------------------------
def bench_keys(a) -> None:
    print(f"\n# persistent key rows loaded by one layer's forward: measured = tiled.KEYS_MOVED over a real tiled "
          f"forward (d={a.d_model}, H={a.heads}, batch 1); model = schedule.keys_moved(N, leaf); naive = N (N - 1) / 2 "
          f"(the naive loop re-reads every earlier key at every step); x less = naive / measured")
    print(f"{'N':>6} {'naive':>10} {'leaf 1':>8} {'model':>8} {'x less':>8} {'leaf 16':>8} {'model':>8} {'x less':>8} "
          f"{'(N/2)log2N':>11}")
    last = {}
    for N in a.key_seqs:
        view = layer(a.d_model, a.heads, N)
        x = torch.randn(1, N, a.d_model)
        measured = {}
        for leaf in (1, 16):
            tiled.KEYS_MOVED[0] = 0
            with torch.no_grad():
                tiled.forward(x, view, leaf)
            measured[leaf] = tiled.KEYS_MOVED[0]
        naive = schedule.naive_keys_moved(N)
        m1, m16 = schedule.keys_moved(N, 1), schedule.keys_moved(N, 16)
        print(f"{N:>6} {naive:>10,} {measured[1]:>8,} {m1:>8,} {naive / measured[1]:>7.1f}x {measured[16]:>8,} "
              f"{m16:>8,} {naive / measured[16]:>7.1f}x {N * int(math.log2(N)) // 2:>11,}", flush=True)
        last = dict(N=N, naive=naive, m1=measured[1], m16=measured[16])
    print(f"RATIO naive/tiled key rows at N={last['N']} = {last['naive'] / last['m1']:.1f}x (leaf 1), "
          f"{last['naive'] / last['m16']:.1f}x (leaf 16: leaf reads cost sum_t (t mod 16) rows but save "
          f"the small tiles' launches)")


# -- memory -----------------------------------------------------------------------------------------
def memory_child(a) -> None:
    """One path, one N, in this process; prints JSON: the step's peak over the RSS before it."""
    N, B, d = a.seq, a.batch, a.d_model
    view = layer(d, a.heads, N)
    xs, gs = inputs(B, 8, d)
    PATHS[a.path](xs, view).backward(gs)  # parameter gradients allocated, libraries warm
    x, g = inputs(B, N, d)
    del xs, gs
    before = status_kib("VmRSS") * 1024
    reset = reset_peak()
    t0 = time.perf_counter()
    PATHS[a.path](x, view).backward(g)  # the parameter gradients accumulate into the existing buffers
    step_s = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024
    print(json.dumps({"mb": (peak - before) / 2**20, "before_mb": before / 2**20, "step_s": step_s,
                      "hwm_reset": reset}))


def bench_memory(a) -> None:
    env = fresh_env(mmap_threshold=None)
    res = {(N, p): [] for N in a.mem_seqs for p in PATHS}
    print(f"memory ({load()}):", flush=True)
    for r in range(a.mem_rounds):
        for N in a.mem_seqs:
            for path in (("tiled", "naive") if r % 2 == 0 else ("naive", "tiled")):
                cmd = [sys.executable, __file__, "_memory_child", "--path", path, "--seq", str(N), "--batch",
                       str(a.batch), "--d-model", str(a.d_model), "--heads", str(a.heads), "--threads", str(a.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
                res[(N, path)].append(json.loads(out.strip().splitlines()[-1]))
                print(f"  N={N} {path}: {res[(N, path)][-1]['mb']:,.1f} MB", flush=True)
    def top_tile_mb(N: int) -> float:
        return a.batch * a.heads * (N // 2) ** 2 * 4 / 2**20

    med = {c: {k: statistics.median(float(x[k]) for x in rs) for k in ("mb", "before_mb", "step_s")}
           for c, rs in res.items()}
    reset = all(x["hwm_reset"] for rs in res.values() for x in rs)
    B, d = a.batch, a.d_model
    print(f"\n# peak memory of one forward + backward of one layer (d={d}, H={a.heads}, B={B}, fp32; gradients of x "
          f"and the parameters): VmHWM after the step minus VmRSS before it (peak {'reset' if reset else 'NOT reset'} "
          f"before the step), fresh process per point under glibc malloc, median of {a.mem_rounds}. For scale: "
          f"x [B, N, d] is {B * a.mem_seqs[-1] * d * 4 / 2**20:.1f} MB at N={a.mem_seqs[-1]}; the naive loop's "
          f"concatenated keys + values come to ~{B * d * 4 * a.mem_seqs[-1] ** 2 / 2**20:,.0f} MB there")
    print(f"{'N':>6} {'tiled MB':>9} {'x prev N':>9} {'naive MB':>9} {'x prev N':>9} {'naive/tiled':>12} "
          f"{'tiled s':>8} {'naive s':>8} {'RSS before MB':>14} {'top tile MB':>12}")
    prev = None
    for N in a.mem_seqs:
        t, n = med[(N, "tiled")], med[(N, "naive")]
        gt = f"{t['mb'] / prev[0]:.2f}x" if prev else "-"
        gn = f"{n['mb'] / prev[1]:.2f}x" if prev else "-"
        print(f"{N:>6} {t['mb']:>9,.1f} {gt:>9} {n['mb']:>9,.1f} {gn:>9} {n['mb'] / t['mb']:>11.1f}x "
              f"{t['step_s']:>8.2f} {n['step_s']:>8.2f} {t['before_mb']:>14,.0f} {top_tile_mb(N):>12,.1f}")
        prev = (t["mb"], n["mb"])
    print(f"(top tile MB: one fp32 [B, H, N/2, N/2] matrix, the scores of the last and largest tile, keys [0, N/2) "
          f"into queries [N/2, N), if it were held whole: it grows 4x per doubling of N. tiled.update_tile and "
          f"tile_grads hold [B, H, {tiled.BLOCK}, N/2] at a time (tiled.BLOCK queries), which keeps the tiled path "
          f"linear; a kernel streaming each tile in key blocks (spec §3.8) would too)")
    for i in range(1, len(a.mem_seqs)):
        N0, N1 = a.mem_seqs[i - 1], a.mem_seqs[i]
        print(f"RATIO memory N={N1}/N={N0}: tiled {med[(N1, 'tiled')]['mb'] / med[(N0, 'tiled')]['mb']:.2f}x, naive "
              f"{med[(N1, 'naive')]['mb'] / med[(N0, 'naive')]['mb']:.2f}x (linear 2x, quadratic 4x)")
    N = a.mem_seqs[-1]
    print(f"RATIO memory naive/tiled at N={N} = {med[(N, 'naive')]['mb'] / med[(N, 'tiled')]['mb']:.1f}x")


# -- time -------------------------------------------------------------------------------------------
class Clock:
    """Wall time accumulated by label (CPU ops are synchronous, so perf_counter around a call is its cost)."""

    def __init__(self):
        self.total, self.calls, self.marks = {}, {}, {}

    @contextlib.contextmanager
    def __call__(self, label: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - t0
            self.calls[label] = self.calls.get(label, 0) + 1

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.perf_counter())


class AutogradVJPs:
    """The layer without its hand-written input gradients (vjp_kv, vjp_post): the tiled backward then
    builds and walks an autograd graph per position in phase 1 (its fallback)."""

    def __init__(self, view: LayerView):
        self.view, self.scale, self.slopes = view, view.scale, view.slopes
        self.pre, self.kv, self.post, self.parameters = view.pre, view.kv, view.post, view.parameters


def has_vjps(view) -> bool:
    return hasattr(view, "vjp_kv") and hasattr(view, "vjp_post")


class TimedLayer:
    """A LayerView whose calls are timed, and mark the backward's phases: phase 1 starts at the first
    one-position kv() or vjp_kv(); phase 2 (instrumented_backward) at the first batched gradient. Exposes
    vjp_kv / vjp_post (and vjp_prepare) only when `vjps` (and the view has them), so the backward takes the
    same branch as for the view."""

    def __init__(self, view: LayerView, clock: Clock, vjps: bool):
        self.view, self.clock = view, clock
        self.scale, self.slopes = view.scale, view.slopes
        if vjps and has_vjps(view):
            self.vjp_kv, self.vjp_post = self._vjp_kv, self._vjp_post
            if hasattr(view, "vjp_prepare"):  # as training: their forward quantities once, before the loop
                self.vjp_prepare = view.vjp_prepare

    def pre(self, x, offset):
        with self.clock("pre"):
            return self.view.pre(x, offset)

    def kv(self, z, offset):
        if z.shape[1] == 1:
            self.clock.mark("phase 1")
            with self.clock("kv"):
                return self.view.kv(z, offset)
        with self.clock("kv all"):
            return self.view.kv(z, offset)

    def post(self, x, a):
        if x.shape[1] == 1:
            with self.clock("post"):
                return self.view.post(x, a)
        with self.clock("post all"):
            return self.view.post(x, a)

    def _vjp_kv(self, *args):
        self.clock.mark("phase 1")
        with self.clock("kv"):
            return self.view.vjp_kv(*args)

    def _vjp_post(self, *args):
        with self.clock("post"):
            return self.view.vjp_post(*args)

    def parameters(self):
        return self.view.parameters()


def instrumented_backward(x, g, view, vjps: bool) -> dict:
    """One tiled backward with its pieces timed (seconds, calls): phases 0/1/2 by the first call that
    opens them; in phase 1 the input gradients of kv and of post at one position (the recomputation and
    autograd.grad on it, or the layer's vjp_kv / vjp_post) and the tile gradients."""
    clock = Clock()
    timed = TimedLayer(view, clock, vjps)
    zero_grads(x, view)
    grad, ops = torch.autograd.grad, tiled.TORCH_OPS

    def timed_grad(outputs, inputs, *args, **kw):
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        label = ("kv" if first.dim() == 3 and first.shape[1] == 1 else
                 "post" if first.dim() == 4 and first.shape[2] == 1 else "grad all")
        if label == "grad all":
            clock.mark("phase 2")  # its first batched gradient (kv's) comes right after the loop
        with clock(label):
            return grad(outputs, inputs, *args, **kw)

    def timed_tiles(*args, **kw):
        with clock("tiles"):
            return ops.grads(*args, **kw)

    try:  # the forward keeps the ops its backward runs (prefill's default: tiled.TORCH_OPS, read when called)
        tiled.TORCH_OPS = tiled.TileOps(ops.update, timed_tiles)
        z = tiled.prefill(x, timed)
        clock.total.clear()
        clock.calls.clear()
        clock.marks.clear()  # the forward's one-position calls opened nothing
        torch.autograd.grad = timed_grad
        t0 = time.perf_counter()
        z.backward(g)
        t_end = time.perf_counter()
    finally:
        torch.autograd.grad, tiled.TORCH_OPS = grad, ops
    p1, p2 = clock.marks.get("phase 1", t0), clock.marks.get("phase 2", t_end)
    inner = sum(clock.total.get(k, 0.0) for k in ("kv", "post", "tiles"))
    return {"total": (t_end - t0, None), "phase 0": (p1 - t0, None), "phase 1": (p2 - p1, None),
            "kv": (clock.total.get("kv", 0.0), None), "post": (clock.total.get("post", 0.0), None),
            "tiles": (clock.total.get("tiles", 0.0), clock.calls.get("tiles")),
            "rest": (p2 - p1 - inner, None), "phase 2": (t_end - p2, None),
            "grad all": (clock.total.get("grad all", 0.0), clock.calls.get("grad all"))}


def backward_breakdown(x, g, view) -> None:
    """The tiled backward's time by piece, with the layer's hand-written input gradients (what training
    runs) and with autograd per position (the fallback), side by side."""
    N = x.shape[1]
    runs = {"hand-written": instrumented_backward(x, g, view, True)} if has_vjps(view) else {}
    runs["autograd"] = instrumented_backward(x, g, view, False)
    print(f"\n# where the tiled backward's time goes at N={N}: one instrumented backward each, phases of spec §3.5 "
          f"(by the first call that opens them); phase 1's per-position input gradients of kv and post by the "
          f"layer's vjp_kv / vjp_post (hand-written) or by recomputing kv() / post() at the position and calling "
          f"torch.autograd.grad on it (autograd){'' if has_vjps(view) else ' (this layer has no vjp_kv / vjp_post)'}")
    print(f"{'piece':<62}" + "".join(f" {n + ' ms':>16} {'share':>6}" for n in runs))
    rows = (("total", "backward"),
            ("phase 0", "phase 0: recompute q, K, V; A from the log-sum-exp"),
            ("phase 1", "phase 1: the reverse loop over positions"),
            ("kv", f"  dz_t from (dK_t, dV_t): kv's input gradient, {N} positions"),
            ("post", f"  g_t from dz_t: post's input gradient, {N} positions"),
            ("tiles", "  tile_grads (dk, dv of the mirrored tiles)"),
            ("rest", "  the rest (slicing, D, casts)"),
            ("phase 2", "phase 2: dq, diagonal terms and the batched VJPs"),
            ("grad all", "  autograd.grad over all positions (pre, kv, post)"))
    for key, label in rows:
        print(f"{label:<62}" + "".join(f" {r[key][0] * 1e3:>16,.1f} {r[key][0] / r['total'][0]:>6.1%}"
                                        for r in runs.values()))


def profile_backwards(x, g, view) -> None:
    """torch.profiler: self CPU time per op of one tiled backward and one naive backward."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    tables = {}
    for path in PATHS:
        zero_grads(x, view)
        z = PATHS[path](x, view)
        with prof(activities=[ProfilerActivity.CPU]) as p:
            z.backward(g)
        tables[path] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in p.key_averages()}
    for path, other in (("tiled", "naive"), ("naive", "tiled")):
        mine, theirs = tables[path], tables[other]
        total = sum(v[0] for v in mine.values())
        print(f"\n# torch.profiler, one {path} backward: self CPU ms by op (total {total:,.0f} ms; {other} "
              f"{sum(v[0] for v in theirs.values()):,.0f} ms), the 15 largest, with {other}'s")
        print(f"{'op':<60} {'ms':>8} {'share':>6} {'calls':>7} {other + ' ms':>9} {'calls':>7}")
        for key, (ms, calls) in sorted(mine.items(), key=lambda kv: -kv[1][0])[:15]:
            o_ms, o_calls = theirs.get(key, (0.0, 0))
            print(f"{key[:60]:<60} {ms:>8,.1f} {ms / total:>6.1%} {calls:>7} {o_ms:>9,.1f} {o_calls:>7}")


def time_paths(view) -> dict:
    """The timed paths: tiled (with the layer's hand-written input gradients where it has them), naive,
    and, where it has them, tiled with autograd per position instead (the backward's fallback)."""
    paths = dict(PATHS)
    if has_vjps(view):
        paths["tiled/autograd"] = lambda x, v: tiled.prefill(x, AutogradVJPs(v))
    return paths


def bench_time(a) -> None:
    N, B, d = a.seq, a.batch, a.d_model
    view = layer(d, a.heads, N)
    x, g = inputs(B, N, d)
    paths = time_paths(view)
    outs = {}
    for name, f in paths.items():  # warm-up, and the paths' results side by side
        zero_grads(x, view)
        z = f(x, view)
        z.backward(g)
        outs[name] = (z.detach(), x.grad.clone())
    ref = outs["naive"]
    diffs = ", ".join(f"{n}: max |z diff| {(o[0] - ref[0]).abs().max().item():.1e}, max |dx diff| / max |dx| "
                      f"{((o[1] - ref[1]).abs().max() / ref[1].abs().max()).item():.1e}" for n, o in outs.items()
                      if n != "naive")
    fwd, bwd = {n: [] for n in paths}, {n: [] for n in paths}
    print(f"time ({load()}):", flush=True)
    for r, order in rounds_of(list(paths), a.rounds):
        for name in order:
            f, b = step(paths[name], x, g, view)
            fwd[name].append(f)
            bwd[name].append(b)
        print(f"  round {r + 1}/{a.rounds}: " + ", ".join(
            f"{n} fwd {fwd[n][-1] * 1e3:,.0f} bwd {bwd[n][-1] * 1e3:,.0f} ms" for n in paths), flush=True)
    full = {n: [f + b for f, b in zip(fwd[n], bwd[n])] for n in paths}

    def ratio(t, num="naive", den="tiled"):  # median over rounds of num / den in the same round
        return statistics.median(u / v for u, v in zip(t[num], t[den]))

    others = [n for n in paths if n not in ("tiled", "naive")]
    print(f"\n# one layer at N={N}, d={d}, H={a.heads}, B={B}, fp32, eager, {torch.get_num_threads()} thread(s); "
          f"forward and backward timed apart; {a.rounds} rounds alternating the order, medians; naive/x: median over "
          f"rounds of the same-round ratio; by min: ratio of the fastest ({load()})")
    print(f"(against naive: {diffs})")
    if others:
        print("(tiled/autograd: the same tiled backward with the per-position input gradients of kv and post taken "
              "by torch.autograd.grad instead of the layer's vjp_kv / vjp_post)")
    print(f"{'what':<20} {'tiled ms':>9} {'min':>7} {'naive ms':>9} {'min':>7} {'naive/tiled':>12} {'by min':>7}"
          + "".join(f" {n + ' ms':>18} {'naive/it':>9}" for n in others))
    for label, t in (("forward", fwd), ("backward", bwd), ("forward + backward", full)):
        print(f"{label:<20} {statistics.median(t['tiled']) * 1e3:>9,.0f} {min(t['tiled']) * 1e3:>7,.0f} "
              f"{statistics.median(t['naive']) * 1e3:>9,.0f} {min(t['naive']) * 1e3:>7,.0f} {ratio(t):>11.2f}x "
              f"{min(t['naive']) / min(t['tiled']):>6.2f}x"
              + "".join(f" {statistics.median(t[n]) * 1e3:>18,.0f} {ratio(t, den=n):>8.2f}x" for n in others))
    per = {(n, k): statistics.median(t[n]) / N * 1e6 for n in paths for k, t in (("f", fwd), ("b", bwd))}
    print("per position: " + "; ".join(f"{n} forward {per[n, 'f']:,.0f} us, backward {per[n, 'b']:,.0f} us"
                                       for n in paths))
    print(f"RATIO naive/tiled backward time at N={N} = {ratio(bwd):.2f}x (the custom backward alone vs autograd's "
          f"backward through the naive loop; target >= 2x, aim 3x)")
    print(f"RATIO naive/tiled forward time at N={N} = {ratio(fwd):.2f}x")
    print(f"RATIO naive/tiled forward+backward time at N={N} = {ratio(full):.2f}x")
    for n in others:
        print(f"RATIO tiled backward, autograd per position / hand-written input gradients = "
              f"{ratio(bwd, num=n):.2f}x")
    backward_breakdown(x, g, view)
    if a.profile:
        profile_backwards(x, g, view)


# -- traffic ----------------------------------------------------------------------------------------
def bench_traffic(a) -> None:
    print("\n# spec §3.4's traffic model (predicted, GPU): persistent key rows loaded per layer forward: naive "
          "N (N - 1) / 2 (one query per step, reading all earlier keys: arithmetic intensity O(1)), tiled "
          "(N/2) log2 N (ruler-sequence tiles, intensity O(N / log N)); values move the same way")
    print(f"{'N':>6} {'naive rows':>12} {'tiled rows':>11} {'predicted HBM gain':>19} {'tiles (launches)':>17}")
    for N in a.traffic_seqs:
        naive, tl = schedule.naive_keys_moved(N), N * int(math.log2(N)) // 2
        print(f"{N:>6} {naive:>12,} {tl:>11,} {naive / tl:>18.1f}x {N - 1:>17,}")
        exact = schedule.keys_moved(N)  # the schedule's own count, printed only where it differs
        if exact != tl:
            print(f"       (schedule.keys_moved({N}) = {exact:,})")
    print("On this CPU both paths do the same attention FLOPs (~2 N^2 d per sequence) in N sequential steps; "
          "the tiled path gains here from not re-concatenating and re-reading the key cache every step and from "
          "batched tiles, not from a faster memory level, so the CPU ratios above are not this prediction.")
    N = a.traffic_seqs[-1]
    print(f"RATIO predicted HBM key-traffic gain at N={N} = "
          f"{schedule.naive_keys_moved(N) / (N * int(math.log2(N)) // 2):.0f}x")


# -- tp ---------------------------------------------------------------------------------------------
def tp_body(rank: int, world: int, B: int, widths: list, count: int, rounds: int) -> dict:
    """On each rank: per width, `rounds` timings of `count` all-reduces of a [B, d] float32 tensor, and
    of one all-reduce of the same bytes ([count, B, d])."""
    import torch.distributed as dist

    out = {}
    for d in widths:
        t = torch.randn(B, d)
        big = torch.randn(count, B, d)
        for _ in range(20):  # warm-up: connections, buffers
            dist.all_reduce(t)
        dist.all_reduce(big)
        many, one = [], []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(count):
                dist.all_reduce(t)
            many.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(big)
            one.append(time.perf_counter() - t0)
        out[d] = {"many": many, "one": one}
    return out


def bench_tp(a) -> None:
    from distributed import run_ranks  # tests/distributed.py

    N, B = a.tp_seq, a.batch
    widths = list(dict.fromkeys([a.tp_width, a.d_model]))
    count = 2 * N
    print(f"tp: 2 gloo ranks, {count} all-reduces of [{B}, d] per width ({load()})", flush=True)
    ranks = run_ranks(tp_body, world_size=2, args=(B, widths, count, a.tp_rounds), timeout=600.0)
    ar = {}
    for d in widths:
        many = [max(r[d]["many"][i] for r in ranks) for i in range(a.tp_rounds)]
        one = [max(r[d]["one"][i] for r in ranks) for i in range(a.tp_rounds)]
        ar[d] = (statistics.median(many), statistics.median(one))
    step_s = {}
    for d in widths:  # one process, the layer's forward + backward (tiled: what training runs)
        heads = a.tp_heads if d == a.tp_width else a.heads
        view = layer(d, heads, N)
        x, g = inputs(B, N, d)
        step(tiled.prefill, x, g, view)  # warm-up
        ts = [sum(step(tiled.prefill, x, g, view)) for _ in range(a.tp_layer_rounds)]
        step_s[d] = (statistics.median(ts), heads)
        print(f"  layer d={d}: forward + backward {step_s[d][0]:.2f} s (median of {a.tp_layer_rounds})", flush=True)
    print(f"\n# tensor parallelism's collectives for one RT layer, per training step: 2 all-reduces of a [B, d] "
          f"fp32 activation per position (after the row-parallel W_O and W_2, inside the recurrence), 2N = {count} "
          f"in the forward at N={N}, B={B}; 2 gloo processes on this machine (loopback tcp, 1 thread each), slower "
          f"rank per round, median of {a.tp_rounds}; beside one process's forward + backward of the whole layer "
          f"(tiled path, {torch.get_num_threads()} thread(s), N={N}, B={B}) ({load()})")
    print(f"{'d':>6} {'H':>4} {'KB/call':>8} {'2N calls ms':>12} {'us/call':>8} {'same bytes, 1 call ms':>22} "
          f"{'layer fwd+bwd ms':>17} {'2N / layer':>11} {'4N / layer':>11} {'4N / (layer/2)':>15} {'TP=2 speedup':>13}")
    for d in widths:
        many, one = ar[d]
        layer_s, heads = step_s[d]
        print(f"{d:>6} {heads:>4} {B * d * 4 / 1024:>8.0f} {many * 1e3:>12,.1f} {many / count * 1e6:>8.0f} "
              f"{one * 1e3:>22,.1f} {layer_s * 1e3:>17,.0f} {many / layer_s:>11.1%} {2 * many / layer_s:>11.1%} "
              f"{2 * many / (layer_s / 2):>15.1%} {layer_s / (layer_s / 2 + 2 * many):>12.2f}x")
    print("(2N / layer: the forward's all-reduces over one process's whole-layer step; 4N: with the backward's "
          "reverse loop, which needs an all-reduce of dz_t and of dh_t per position as well; 4N / (layer/2): over "
          "the compute each of 2 TP ranks would keep; TP=2 speedup: layer / (layer/2 + 4N all-reduces), ideal 2x)")
    fwd_us = 81.73e3 / 512  # spec §3.7: one layer's forward, seq 512, d=1024, batch 512, H100 with CUDA graphs
    print(f"For scale on a GPU (not measured here): spec §3.7's layer forward (d=1024, N=512, B=512, H100, CUDA "
          f"graphs) is 81.73 ms, {fwd_us:.0f} us per position; 2 NCCL all-reduces per position at an assumed "
          f"10-30 us each would add {2 * 10 / fwd_us:.0%}-{2 * 30 / fwd_us:.0%} to it, before the backward's.")
    d = widths[0]
    print(f"RATIO TP all-reduce time / layer fwd+bwd time at d={d}, N={N}, B={B} = {ar[d][0] / step_s[d][0]:.1%} "
          f"(forward's 2N; {2 * ar[d][0] / step_s[d][0]:.1%} with the backward's); {ar[d][0] / count * 1e6:.0f} us "
          f"per call vs {ar[d][1] / count * 1e6:.1f} us per call's bytes in one all-reduce")


# -- main -------------------------------------------------------------------------------------------
def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", metavar="SECTION",
                   help=f"sections to run: all (the default) or any of {', '.join(SECTIONS)} (run in that order)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: memory at N=64,128,256 once each, time at N=128 with 1 round, tp at N=64 with "
                        "1 round (figures imprecise)")
    p.add_argument("--profile", action="store_true", help="time: torch.profiler tables of one backward of each path")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in this process and the memory children (default 1; see above)")
    p.add_argument("--d-model", type=int, default=64, help="d of the benchmarked layer (keys, memory, time; tp too)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="B, sequences (memory, time, tp)")
    p.add_argument("--seq", type=int, default=512, help="time: N")
    p.add_argument("--rounds", type=int, default=5, help="time: alternating rounds (medians)")
    p.add_argument("--key-seqs", type=ints, default=[256, 512, 1024], help="keys: the Ns, comma-separated")
    p.add_argument("--mem-seqs", type=ints, default=[256, 512, 1024], help="memory: the Ns, comma-separated")
    p.add_argument("--mem-rounds", type=int, default=3, help="memory: fresh processes per (N, path), alternating")
    p.add_argument("--traffic-seqs", type=ints, default=[512, 1024, 2048, 4096], help="traffic: the Ns")
    p.add_argument("--tp-seq", type=int, default=512, help="tp: N (2N all-reduces; the layer timed at this N)")
    p.add_argument("--tp-width", type=int, default=1024, help="tp: the wide d (the paper's 150M-12L width)")
    p.add_argument("--tp-heads", type=int, default=16, help="tp: heads of the wide layer (dh 64)")
    p.add_argument("--tp-rounds", type=int, default=5, help="tp: timed rounds of the all-reduces")
    p.add_argument("--tp-layer-rounds", type=int, default=2, help="tp: timed forward + backward of each layer")
    p.add_argument("--path", default="tiled", choices=list(PATHS), help=argparse.SUPPRESS)  # _memory_child
    sections.run(p, SECTIONS, globals(), children={"_memory_child": memory_child}, quick=_quick,
                 note="memory children: glibc malloc")


def _quick(a) -> None:
    (a.mem_seqs, a.mem_rounds, a.seq, a.rounds, a.tp_seq, a.tp_rounds,
     a.tp_layer_rounds) = [64, 128, 256], 1, 128, 1, 64, 1, 1


if __name__ == "__main__":
    main()
