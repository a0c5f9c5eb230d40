"""GPN (spec-002) on this machine: BPTT memory with and without segment recomputation, the hoisted
training form against the naive per-step loop (with what a FLOP, memory-traffic and dispatch model
predicts for hoisting, and what torch.compile of the step adds), and decode against the Transformer++
of the same parameters. Figures only, nothing asserted.

    PYTHONPATH=. python benchmarks/bench_gpn.py                    # every section (~10 min on 2 busy cores)
    PYTHONPATH=. python benchmarks/bench_gpn.py memory hoist       # just these
    PYTHONPATH=. python benchmarks/bench_gpn.py --quick            # a smoke run (figures imprecise)

memory: one training step (forward + backward) of a small GPN+M (--mem-width: d, E = d/2, F = 2d, 4
heads of 32 x 64; the loss chunked, model.loss_chunk=256, so that the [T, V] logits, O(T) with or
without recompute, do not hide the recurrence) at batch --mem-batch, T = 256, 1024 and 4096, with
parallel.recompute=none (every step's activations kept) and full (segments of ceil(sqrt(T)) steps, each
recomputed in the backward), each in a fresh process under glibc malloc (procmem.fresh_env); the peak is
VmHWM after the step (reset to the RSS just before it) minus the RSS before it, after a short step that
allocated the gradients. Memory grows like T without recomputation and like sqrt(T) with it (T/S
segment-start states plus one live segment, S = sqrt(T)), on top of what is O(T) either way and small:
the inputs, the s^p outputs, the loss.

hoist: a training step (forward, backward) of the same model and batch in two forms: the model's own
(fuse, decode and loss over the whole window outside the time loop; inside it, each state's
projections as one folded matrix product) and the naive per-step loop written here from the same
modules (per step: embed, fuse, every projection with its own norm, decode, logits and cross-entropy:
the released JAX code's step, spec §5.1.4). At the tiny config (T=128, batch 16) and at the 130M
1-layer shape (T=256, batch 1, one round: a few minutes per form). The model beside it: time =
max(FLOPs / peak, bytes / bandwidth) + ops x per-op cost, with the fp32 matmul peak, the memory
bandwidth (a 256 MB copy) and the cost of a small op probed here; the FLOPs are the forms' (equal: the
same arithmetic); the bytes are the weights each step streams (`predicted` has the counts: every weight
every step in the naive form, the V x E head included; the loop's every step and the rest once per
window in the hoisted one); the ops are the aten ops each form dispatches per training step, counted
with a dispatch mode. Predicted gain = naive time / hoisted time by that model; the issue's bar is
80% of the gain above 1. Then torch.compile of the step (model.iterate) at the tiny config.

decode: tokens/s of streaming decode, batch 1, after a 2,048-token context, for GPN+M 130M (its state
is the same size at any context: it decodes from a state built from 64 tokens) and the Transformer++ of
the same parameters (configs/baseline/gpn-130m: KV cache of 2,048 tokens, prefilled by one forward); and
the bytes each keeps per sequence at that context.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import sections  # noqa: E402  (benchmarks/)
from bench_sps import adamw, batch_of  # noqa: E402  (benchmarks/)
from procmem import fresh_env, reset_peak, status_kib  # noqa: E402  (benchmarks/)
from pretrain.config import load_config  # noqa: E402
from pretrain.metrics import probe_cpu_peak_tflops  # noqa: E402
from pretrain.models import get_arch  # noqa: E402
from pretrain.models.gpn import GPN, GPNConfig, parameter_counts  # noqa: E402

SECTIONS = ("memory", "hoist", "decode")


def small_cfg(d: int, vocab: int, loss_chunk: int = 0) -> GPNConfig:
    return GPNConfig(vocab_size=vocab, d_emb=d // 2, d_state=d, d_ffn=2 * d, mem_heads=4, d_key=32, d_value=64,
                     loss_chunk=loss_chunk)


def tiny_cfg() -> GPNConfig:
    return load_config("gpn/tiny", [], check_data=False).model


def build(cfg: GPNConfig, recompute: bool = False) -> GPN:
    torch.manual_seed(0)
    model = GPN(cfg).train()
    model.segment_recompute = recompute
    return model


# -- memory ---------------------------------------------------------------------------------------------
def memory_child(a) -> None:
    model = build(small_cfg(a.mem_width, a.vocab, a.mem_loss_chunk), a.recompute == "full")
    model(batch_of(1, 8, a.vocab))[0].backward()  # gradients allocated, libraries warm
    batch = batch_of(a.mem_batch, a.seq, a.vocab)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status_kib("VmRSS") * 1024
    reset = reset_peak()
    t0 = time.perf_counter()
    model(batch)[0].backward()
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024
    print(json.dumps({"mb": (peak - before) / 2**20, "s": seconds, "reset": reset}))


def bench_memory(a) -> None:
    res = {}
    print(f"memory ({sections.load()}):", flush=True)
    for T in a.mem_seqs:
        for policy in ("none", "full"):
            cmd = [sys.executable, __file__, "_memory_child", "--recompute", policy, "--seq", str(T), "--mem-width",
                   str(a.mem_width), "--mem-batch", str(a.mem_batch), "--vocab", str(a.vocab), "--threads",
                   str(a.threads), "--mem-loss-chunk", str(a.mem_loss_chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=fresh_env())
            if out.returncode:
                raise SystemExit(f"memory child failed:\n{out.stderr[-3000:]}")
            res[(T, policy)] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  T={T} recompute {policy}: {res[(T, policy)]['mb']:,.1f} MB in {res[(T, policy)]['s']:.1f} s",
                  flush=True)
    cfg = small_cfg(a.mem_width, a.vocab, a.mem_loss_chunk)
    cell_mb = a.mem_batch * cfg.mem_heads * cfg.d_key * cfg.d_value * 4 / 2**20
    print(f"\n# peak activation memory of one training step (forward + backward), GPN+M d={cfg.d_state} E={cfg.d_emb} "
          f"F={cfg.d_ffn} memory {cfg.mem_heads} x {cfg.d_key} x {cfg.d_value}, vocab {a.vocab}, batch {a.mem_batch}, "
          f"model.loss_chunk={cfg.loss_chunk}, fp32; fresh process each; one memory M = {cell_mb:.2f} MB; estimate: "
          f"the planner's activation_bytes")
    from pretrain.models.gpn import activation_bytes

    print(f"{'T':>6} {'S':>4} {'none MB':>9} {'estimate':>9} {'full MB':>9} {'estimate':>9} {'full/none':>10} "
          f"{'step s none':>12} {'step s full':>12}")
    for T in a.mem_seqs:
        n, f = res[(T, "none")], res[(T, "full")]
        est = {p: activation_bytes(cfg, T, a.mem_batch, p) / 2**20 for p in ("none", "full")}
        print(f"{T:>6} {cfg.segment_for(T):>4} {n['mb']:>9,.1f} {est['none']:>9,.1f} {f['mb']:>9,.1f} {est['full']:>9,.1f} "
              f"{f['mb'] / n['mb']:>9.2f}x {n['s']:>12.2f} {f['s']:>12.2f}")
    for lo, hi in zip(a.mem_seqs, a.mem_seqs[1:]):
        k = hi / lo
        print(f"RATIO T={hi} / T={lo} ({k:.0f}x the window): none {res[(hi, 'none')]['mb'] / res[(lo, 'none')]['mb']:.2f}x "
              f"(linear: {k:.0f}x), full {res[(hi, 'full')]['mb'] / res[(lo, 'full')]['mb']:.2f}x (sqrt: {math.sqrt(k):.1f}x)")


# -- hoist ------------------------------------------------------------------------------------------------
def naive_loss(m: GPN, tokens, labels) -> torch.Tensor:
    """The per-step loop of the released code: embed, fuse, every projection with its own norm, decode,
    logits and cross-entropy inside the step (spec §2.10 with §5.1.4's in-loop decode); context targets."""
    c = m.cfg
    B, T = tokens.shape
    H, dk, dv = c.mem_heads, c.d_key, c.d_value
    sgp = torch.zeros(B, c.d_state)
    sp = torch.zeros(B, c.d_state)
    M = torch.zeros(B, H, dk, dv)
    total = 0.0
    unit = lambda x: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)  # noqa: E731
    for t in range(T):
        g = m.fuse(m.fuse_norm(m.embed(tokens[:, t])))
        sg = torch.sigmoid(m.fuse_gate.proj(m.fuse_gate.norm(sp))) * sp + g
        if H:
            w = m.write
            u, um = w.norm(sg), w.norm(sgp)
            k = unit(F.relu(w.k(um)).view(B, H, dk))
            v = w.v(u).view(B, H, dv)
            beta = torch.sigmoid(w.beta(u))
            alpha = torch.exp(-w.A_log.exp() * F.softplus(w.a(u) + w.dt_bias))
            erase = torch.einsum("bhkv,bhk->bhv", M, k)
            M = alpha[..., None, None] * M + (beta[..., None] * (v - erase))[..., None, :] * k[..., :, None]
        s = sg
        for layer in m.layers:
            a_, b_ = layer.w1(layer.ffn_norm(s)).chunk(2, -1)
            new = torch.sigmoid(layer.gate.proj(layer.gate.norm(s))) * s + layer.w2(F.silu(a_) * b_)
            if H:
                y = layer.read_norm(s)
                q = unit(F.relu(layer.q(y)).view(B, H, dk))
                o = torch.einsum("bhkv,bhk->bhv", M, q).flatten(1)
                new = new + layer.o(F.silu(layer.rg(y)) * layer.out_norm(o))
            s = new
        logits = m.dproj(m.dec_norm(s)) @ m.embed.weight.T
        total = total + F.cross_entropy(logits, labels[:, t], reduction="sum")
        sgp, sp = sg, s
    return total / (B * T)


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _step(fn, model, opt, batch) -> float:
    t0 = time.perf_counter()
    fn(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


FORMS = {"naive": lambda m, b: naive_loss(m, b.tokens, b.labels), "hoisted": lambda m, b: m(b)[0]}


def probe_bandwidth() -> float:
    """Bytes per second of a copy (read + write) of 256 MB, far above the caches: the memory-traffic roof."""
    x = torch.ones(256 * 2**20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    return 5 * 2 * x.numel() * 4 / (time.perf_counter() - t0)


def probe_op_cost() -> float:
    """Seconds per small aten op (the dispatch and launch cost a per-step loop pays per op)."""
    x = torch.ones(64, 64)
    for _ in range(100):
        x = x * 1.0001
    t0 = time.perf_counter()
    for _ in range(2000):
        x = x * 1.0001
    return (time.perf_counter() - t0) / 2000


def predicted(cfg: GPNConfig, B: int, T: int, ops: dict, peak: float, bw: float, op_s: float) -> dict:
    """Seconds per training step of each form by the model: max(FLOPs / peak, bytes / bandwidth) + ops x op_s.
    Bytes: a weight used in a step is read in the forward and in the backward and its gradient is computed
    and accumulated (4 + 4 + 4 + 8 = 20 bytes per parameter); the naive form uses every weight every step
    (the head's V x E included), the hoisted one the loop's every step, the rest once per window, plus
    folding the norms into the loop's matrices once per window (8 bytes forward, 12 backward); AdamW
    reads and writes parameters, moments and gradients once per step (28 bytes) in both."""
    n = parameter_counts(cfg)
    flops = 6.0 * n["total"] * B * T  # per training step, both forms
    loop, out = n["loop"], n["total"] - n["loop"]
    bytes_ = {"naive": 20.0 * (loop + out) * T, "hoisted": 20.0 * (loop * T + out) + 20.0 * loop}
    return {f: max(flops / peak, (bytes_[f] + 28.0 * n["total"]) / bw) + ops[f] * op_s for f in FORMS}


def bench_hoist(a) -> None:
    peak, bw, op_s = probe_cpu_peak_tflops(a.threads) * 1e12, probe_bandwidth(), probe_op_cost()
    print(f"\nhoist ({sections.load()}): probed fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, copy bandwidth "
          f"{bw / 1e9:.1f} GB/s, {op_s * 1e6:.1f} us per small op", flush=True)
    shapes = [("tiny", tiny_cfg(), 16, 128, a.rounds), ("130M 1L", GPNConfig(), 1, a.paper_seq, a.paper_rounds)]
    rows = []
    for name, cfg, B, T, rounds in shapes:
        model = build(cfg, recompute=False)
        opt = adamw(model)
        batch = batch_of(B, T, cfg.vocab_size)
        with torch.no_grad():
            lh, ln = model(batch)[0].item(), naive_loss(model, batch.tokens, batch.labels).item()
        ops = {}
        for f, fn in FORMS.items():
            with OpCount() as c:
                fn(model, batch).backward()
            ops[f] = c.n
            opt.zero_grad(set_to_none=True)
        times = {f: [] for f in FORMS}
        for r in range(rounds):
            for f in (FORMS if r % 2 == 0 else list(FORMS)[::-1]):
                times[f].append(_step(FORMS[f], model, opt, batch))
        pred = predicted(cfg, B, T, ops, peak, bw, op_s)
        med = {f: statistics.median(t) for f, t in times.items()}
        rows.append((name, B, T, med, pred, ops, abs(lh - ln)))
        print(f"  {name}: naive {med['naive']:.2f} s, hoisted {med['hoisted']:.2f} s per step (losses agree to "
              f"{abs(lh - ln):.1e})", flush=True)
    print(f"\n# training step (forward + backward + AdamW), fp32, eager, {torch.get_num_threads()} thread(s); predicted: "
          "max(FLOPs / peak, weight bytes / bandwidth) + aten ops x per-op cost")
    print(f"{'shape':<9} {'B x T':>9} {'ops naive':>10} {'ops hoisted':>12} {'tok/s naive':>12} {'tok/s hoisted':>14} "
          f"{'gain':>6} {'predicted':>10} {'of predicted':>13}")
    for name, B, T, med, pred, ops, _ in rows:
        gain, want = med["naive"] / med["hoisted"], pred["naive"] / pred["hoisted"]
        print(f"{name:<9} {B:>4} x {T:<4} {ops['naive']:>10,} {ops['hoisted']:>12,} {B * T / med['naive']:>12,.0f} "
              f"{B * T / med['hoisted']:>14,.0f} {gain:>5.2f}x {want:>9.2f}x {(gain - 1) / max(want - 1, 1e-9):>12.0%}")
        print(f"RATIO {name} hoisted/naive tokens/s = {gain:.2f}x (predicted {want:.2f}x; the gain above 1 is "
              f"{(gain - 1) / max(want - 1, 1e-9):.0%} of the predicted gain's; bar 80%)")
    bench_compile(a)


def bench_compile(a) -> None:
    cfg = tiny_cfg()
    batch = batch_of(16, 128, cfg.vocab_size)
    eager, compiled = build(cfg), build(cfg)
    compiled.iterate = torch.compile(compiled.iterate, dynamic=False)
    models = {"eager": eager, "compiled step": compiled}
    opts = {n: adamw(m) for n, m in models.items()}
    t0 = time.perf_counter()
    _step(FORMS["hoisted"], compiled, opts["compiled step"], batch)
    warm = time.perf_counter() - t0
    _step(FORMS["hoisted"], eager, opts["eager"], batch)
    times = {n: [] for n in models}
    for r in range(a.rounds):
        for n in (models if r % 2 == 0 else list(models)[::-1]):
            times[n].append(_step(FORMS["hoisted"], models[n], opts[n], batch))
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\n# torch.compile of the step (model.iterate), tiny config, batch 16 x T=128; first step with compilation "
          f"{warm:.1f} s")
    for n in models:
        print(f"{n:<14} {med[n] * 1e3:>8,.0f} ms/step {16 * 128 / med[n]:>9,.0f} tok/s")
    print(f"RATIO compiled step / eager tokens/s = {med['eager'] / med['compiled step']:.2f}x")


# -- decode -----------------------------------------------------------------------------------------------
def bench_decode(a) -> None:
    torch.manual_seed(0)
    gpn = GPN(GPNConfig()).eval()
    spec_b = get_arch("baseline")
    bcfg = load_config("baseline/gpn-130m", [f"model.max_seq_len={a.context + a.decode_tokens}"], check_data=False).model
    base = spec_b.build(bcfg).eval()
    ctx = torch.randint(5, 32000, (1, a.context))
    n = a.decode_tokens
    with torch.no_grad():
        state = gpn.new_state(1)
        gpn.step(ctx[:, :64], state)  # the state has one size at any context
        t0 = time.perf_counter()
        tok = ctx[:, -1:]
        for _ in range(n):
            logits, state = gpn.step(tok, state)
            tok = logits[:, -1].argmax(-1, keepdim=True)
        g_s = (time.perf_counter() - t0) / n
        cache = spec_b.new_state(base, 1)
        t0 = time.perf_counter()
        logits, cache = spec_b.step(base, ctx, cache)
        prefill = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(n):
            logits, cache = spec_b.step(base, tok, cache)
            tok = logits[:, -1].argmax(-1, keepdim=True)
        b_s = (time.perf_counter() - t0) / n
    g_bytes = sum(t.numel() * t.element_size() for t in state)
    b_bytes = 2 * bcfg.n_layers * a.context * bcfg.d_model * 4  # keys and values at the context, fp32
    print(f"\n# decode, batch 1, after {a.context} tokens, fp32, {n} tokens each ({sections.load()}); the baseline's prefill "
          f"took {prefill:.1f} s")
    print(f"{'model':<26} {'params':>13} {'tok/s':>7} {'state bytes/seq':>16}")
    print(f"{'GPN+M 130M 1L':<26} {parameter_counts(gpn.cfg)['total']:>13,} {1 / g_s:>7.1f} {g_bytes:>16,}")
    from pretrain.models.registry import count_parameters

    print(f"{'Transformer++ gpn-130m':<26} {count_parameters(base)['total']:>13,} {1 / b_s:>7.1f} {b_bytes:>16,}")
    print(f"RATIO GPN+M / Transformer++ decode tokens/s at {a.context} = {b_s / g_s:.2f}x; state bytes = "
          f"{g_bytes / b_bytes:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", metavar="SECTION",
                   help=f"sections to run: all (the default) or any of {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="a smoke run: short windows, one round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the 2 cores here are shared)")
    p.add_argument("--vocab", type=int, default=4096, help="memory: the vocabulary")
    p.add_argument("--mem-width", type=int, default=256, help="memory: d")
    p.add_argument("--mem-batch", type=int, default=2, help="memory: sequences per step")
    p.add_argument("--mem-loss-chunk", type=int, default=256,
                   help="memory: model.loss_chunk (0: the whole [T, V] logits, which then dominate and grow like T)")
    p.add_argument("--mem-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 4096],
                   help="memory: the windows T, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="hoist: alternating rounds at the tiny config (medians)")
    p.add_argument("--paper-seq", type=int, default=256, help="hoist: T at the 130M shape (batch 1)")
    p.add_argument("--paper-rounds", type=int, default=1, help="hoist: rounds at the 130M shape")
    p.add_argument("--context", type=int, default=2048, help="decode: the context")
    p.add_argument("--decode-tokens", type=int, default=16, help="decode: tokens timed")
    p.add_argument("--recompute", default="none", help=argparse.SUPPRESS)  # _memory_child
    p.add_argument("--seq", type=int, default=256, help=argparse.SUPPRESS)  # _memory_child
    sections.run(p, SECTIONS, globals(), children={"_memory_child": memory_child}, quick=_quick)


def _quick(a) -> None:
    a.mem_seqs, a.rounds, a.paper_seq, a.context, a.decode_tokens = [64, 256], 1, 16, 256, 4


if __name__ == "__main__":
    main()
