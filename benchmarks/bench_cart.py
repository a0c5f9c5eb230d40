"""CART (spec-004) on this machine: training step time against the Dense baseline of the same stored
parameters at R = 2, 6, 10; peak activation memory with and without per-pass recompute; random depth
with truncated backprop against a fixed R with full backprop. Figures only, nothing asserted.

    PYTHONPATH=. python benchmarks/bench_cart.py                # all three sections (~7 min on 2 busy cores)
    PYTHONPATH=. python benchmarks/bench_cart.py train memory   # just these sections
    PYTHONPATH=. python benchmarks/bench_cart.py random --random-extra   # also uniform full backprop, huginn
    PYTHONPATH=. python benchmarks/bench_cart.py --quick        # a smoke run: d=256, micro-batch 1, 1 round

Models: pretrain.models.cart.CART at d=--d-model (default 512, H = d/64), P=--prelude prelude layers
(default 6, the paper's Stage 2), one coda layer, vocab --vocab (default 32,000, the paper's), T=--seq
(default 256) tokens per sequence, micro-batch --batch sequences (default 4: 1,024 tokens per step),
fp32, eager, --threads torch threads (default 1: the 2 cores here are shared with another process,
and 2 threads made the same steps slower and far noisier: 1.7-5.4 s against 1.3-2.0 s with 1 at
d=256). The Dense baseline is the same class with model.dense=true (spec §2.11: full-rank
self-attention layers, the same SwiGLU, norms and tied head), with the number of layers L whose stored
count is closest to CART's (at the defaults 7, the paper's Dense 7L); both counts are printed, from
the formula (cart.parameter_counts) and counted on the model.

train: one step = forward + backward + fused AdamW step + zero_grad on the same fixed batch (random
ids). CART at R = 2, 6, 10, CART R=10 under the registry's recompute policy "pass" (each core pass
checkpointed whole, and the prelude's and coda's blocks), under policy "loop" (only the core
passes), R=10 and R=10 pass with model.loss_chunk=--loss-chunk, and the Dense baseline. One warm-up
step each, then --rounds rounds, the order reversed every other round (the load here drifts); median
step times, and "x Dense": the median over rounds of the ratio to Dense's step in the same round
(the RATIO lines). Beside them the registry's FLOPs per token (cart.flops_per_token), whose ratio is
what the step-time ratio would be if every FLOP cost the same.

memory: one training step at R=10 (and at R=1, to split out what each extra pass costs), recompute
policies none, loop (each core pass checkpointed whole: blend, loop-index embedding, core block,
gate) and pass (loop's passes and the prelude's and coda's blocks), with the whole-logits loss and
with model.loss_chunk=--loss-chunk (kernels/lm_loss, no [N, V] logits kept), each configuration in a
fresh process under glibc malloc (MALLOC_ARENA_MAX=1, nothing preloaded, and a fixed
MALLOC_MMAP_THRESHOLD_ of 64 KiB with malloc_trim before each measured step, so RSS follows use step
after step). A one-token step first allocates the weights' gradients and AdamW moments (kept:
zero_grad(set_to_none=False)); the peak is VmHWM after the step (reset to the current RSS just
before it through /proc/self/clear_refs, procmem.reset_peak) minus VmRSS before it
(benchmarks/procmem.py). --mem-rounds processes per configuration, alternating; medians. The issue's
target for per-pass recompute: at most half the activation memory (<= 0.50x) for at most 40% more
step time (<= 1.40x, from the train section's paired rounds).

random: random depth per step with truncated backprop (model.loops_sampling=uniform, loops_min=2,
n_loops=10, backprop_loops=2: R ~ U{2..10}, only the last 2 passes get gradient) against a fixed R=10
with full backprop, over the same --random-steps steps: each step's R is drawn from its generator,
ctx = StepContext.for_step(--seed, step), as the trainer does, so every configuration sees the same
draws. Step by step, the configurations alternate (reversed every other step); mean (and median) step
time and the ratio of the means. Then each configuration runs the same steps in a fresh process
(as in memory), every step's activation peak measured on its own; the peak is the largest. With
--random-extra also: uniform R ~ U{2..10} with full backprop (the draw alone, without the truncation)
and huginn with mean 10 (R = 1 + Poisson(lambda), lambda log-normal; its fewest draw is 1, so the
largest truncation it allows is backprop_loops=1).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import sections  # noqa: E402  (benchmarks/)
from bench_sps import adamw, batch_of, load, paired, rounds_of  # noqa: E402  (benchmarks/)
from procmem import fresh_env, reset_peak, status_kib  # noqa: E402  (benchmarks/)
from pretrain.models import get_arch  # noqa: E402
from pretrain.models.base import StepContext  # noqa: E402
from pretrain.models.cart import CART, CARTConfig, parameter_counts  # noqa: E402
from pretrain.models.registry import count_parameters  # noqa: E402

SECTIONS = ("train", "memory", "random")
SPEC = get_arch("cart")
WARMUP_STEP = 1_000_000  # the warm-up steps' context: outside every timed step set


# -- models -------------------------------------------------------------------------------------------
def cart_cfg(a, **kw) -> CARTConfig:
    values = dict(vocab_size=a.vocab, d_model=a.d_model, n_heads=a.d_model // 64, n_layers=a.prelude, n_loops=10,
                  max_seq_len=a.seq)
    values.update(kw)
    return CARTConfig(**values)


def dense_layers(a) -> int:
    """The Dense baseline's L: the layer count whose stored parameters are closest to CART's."""
    target = parameter_counts(cart_cfg(a))["stored"]
    return min(range(1, 65),
               key=lambda L: abs(parameter_counts(cart_cfg(a, dense=True, n_layers=L))["stored"] - target))


def counted(cfg: CARTConfig) -> int:
    with torch.device("meta"):
        return count_parameters(CART(cfg))["total"]


def build(cfg: CARTConfig, policy: str = "none") -> CART:
    torch.manual_seed(0)
    model = CART(cfg).train()
    if policy != "none":
        SPEC.recompute_policies()[policy].apply(model)  # parallel/recompute.py, as the trainer applies it
    return model


def step(model, opt, batch, ctx) -> tuple[float, int]:
    """(seconds, R drawn) of one forward + backward + AdamW step + zero_grad."""
    t0 = time.perf_counter()
    loss, diag = model(batch, ctx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, int(diag.get("loops", torch.tensor(0.0)).item())


def mflop(cfg: CARTConfig, a, ctx=None) -> float:
    return SPEC.flops_per_token(cfg, a.seq, ctx) / 1e6


# -- train --------------------------------------------------------------------------------------------
def train_models(a) -> dict[str, tuple[CARTConfig, str]]:
    L = dense_layers(a)
    models = {f"Dense {L}L": (cart_cfg(a, dense=True, n_layers=L), "none")}
    for R in (2, 6, 10):
        models[f"CART R={R}"] = (cart_cfg(a, n_loops=R), "none")
    models["CART R=10 loop"] = (cart_cfg(a, n_loops=10), "loop")
    models["CART R=10 pass"] = (cart_cfg(a, n_loops=10), "pass")
    if a.loss_chunk:
        models["CART R=10 chunk"] = (cart_cfg(a, n_loops=10, loss_chunk=a.loss_chunk), "none")
        models["CART R=10 pass chunk"] = (cart_cfg(a, n_loops=10, loss_chunk=a.loss_chunk), "pass")
    return models


def bench_train(a) -> None:
    specs = train_models(a)
    dense = next(iter(specs))
    print(f"\n# the models: d={a.d_model} H={a.d_model // 64} P={a.prelude} (+1 coda layer), FFN {cart_cfg(a).ffn}, "
          f"key/value latent {cart_cfg(a).rank}, vocab {a.vocab}, T={a.seq}; the Dense baseline: model.dense=true "
          f"with the L closest in stored parameters")
    print(f"{'model':<20} {'stored (formula)':>17} {'stored (counted)':>17} {'effective':>12} {'x Dense stored':>15} "
          f"{'MFLOP/token':>12}")
    ref = parameter_counts(specs[dense][0])["stored"]
    for name, (cfg, _) in specs.items():
        n = parameter_counts(cfg)
        print(f"{name:<20} {n['stored']:>17,} {counted(cfg):>17,} {n['effective']:>12,} "
              f"{n['stored'] / ref:>14.3f}x {mflop(cfg, a):>12.0f}")
    models = {name: build(cfg, policy) for name, (cfg, policy) in specs.items()}
    opts = {n: adamw(m) for n, m in models.items()}
    batch = batch_of(a.batch, a.seq, a.vocab)
    warm = StepContext.for_step(a.seed, WARMUP_STEP)
    for n, m in models.items():  # warm-up: allocator, optimizer state
        step(m, opts[n], batch, warm)
    times = {n: [] for n in models}
    print(f"train ({load()}):", flush=True)
    for r, order in rounds_of(list(models), a.rounds):
        for n in order:
            times[n].append(step(models[n], opts[n], batch, StepContext.for_step(a.seed, r))[0])
        print(f"  round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:,.0f} ms" for n, t in times.items()),
              flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    tokens = a.batch * a.seq
    print(f"\n# training step (forward + backward + fused AdamW + zero_grad), micro-batch {a.batch} x T={a.seq} = "
          f"{tokens} tokens, fp32, eager, {torch.get_num_threads()} thread(s); {a.rounds} alternating rounds "
          f"({load()})")
    print("# x Dense: median over rounds of the ratio to Dense's step in the same round; by min: ratio of the fastest "
          "steps; FLOPs x Dense: the ratio of the registry's FLOPs per token")
    print(f"{'model':<20} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'tokens/s':>9} {'x Dense':>8} {'by min':>7} "
          f"{'FLOPs x Dense':>14}")
    fd = mflop(specs[dense][0], a)
    for n in models:
        t = times[n]
        print(f"{n:<20} {med[n] * 1e3:>10,.0f} {min(t) * 1e3:>8,.0f} {max(t) * 1e3:>8,.0f} {tokens / med[n]:>9,.0f} "
              f"{paired(times, n, dense):>7.2f}x {min(t) / min(times[dense]):>6.2f}x "
              f"{mflop(specs[n][0], a) / fd:>13.2f}x")
    for R in (2, 6, 10):
        n = f"CART R={R}"
        print(f"RATIO {n}/{dense} step time = {paired(times, n, dense):.2f}x (by min "
              f"{min(times[n]) / min(times[dense]):.2f}x; FLOPs {mflop(specs[n][0], a) / fd:.2f}x; stored parameters "
              f"{parameter_counts(specs[n][0])['stored'] / parameter_counts(specs[dense][0])['stored']:.3f}x)")
    for policy, suffix, loss in (("loop", "", "whole logits"), ("pass", "", "whole logits"),
                                 ("pass", " chunk", f"model.loss_chunk={a.loss_chunk}")):
        n, base = f"CART R=10 {policy}{suffix}", f"CART R=10{suffix}"
        if n in times:
            print(f"RATIO CART R=10 recompute {policy}/none step time, loss {loss} = {paired(times, n, base):.2f}x "
                  f"(by min {min(times[n]) / min(times[base]):.2f}x; target <= 1.40x)")
    if "CART R=10 chunk" in times:
        print(f"RATIO CART R=10 loss chunked/whole step time = {paired(times, 'CART R=10 chunk', 'CART R=10'):.2f}x")


# -- fresh processes ------------------------------------------------------------------------------------
def run_child(a, policy: str = "none", steps: int = 1, **kw) -> list[dict]:
    """The child's per-step records: its CART config is cart_cfg(a, **kw)."""
    cmd = [sys.executable, __file__, "_child", "--policy", policy, "--child-steps", str(steps), "--cfg", json.dumps(kw),
           "--threads", str(a.threads), "--d-model", str(a.d_model), "--prelude", str(a.prelude), "--vocab",
           str(a.vocab), "--seq", str(a.seq), "--batch", str(a.batch), "--seed", str(a.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=fresh_env())
    if out.returncode:
        raise SystemExit(f"child {' '.join(cmd[2:])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(a) -> None:
    """In this fresh process: steps 0.. of one configuration, each step's activation peak on its own."""
    model = build(cart_cfg(a, **json.loads(a.cfg)), a.policy)
    opt = adamw(model)
    model(batch_of(1, 1, a.vocab), StepContext.for_step(a.seed, WARMUP_STEP))[0].backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradient buffers: they are not activations
    batch = batch_of(a.batch, a.seq, a.vocab)
    records = []
    libc = ctypes.CDLL("libc.so.6")
    for i in range(a.child_steps):
        libc.malloc_trim(0)  # what the last step freed on the heap leaves RSS before this one is measured
        before = status_kib("VmRSS") * 1024
        reset = reset_peak()
        t0 = time.perf_counter()
        loss, diag = model(batch, StepContext.for_step(a.seed, i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        seconds = time.perf_counter() - t0
        peak = status_kib("VmHWM") * 1024
        records.append({"mb": (peak - before) / 2**20, "before_mb": before / 2**20, "s": seconds,
                        "loops": int(diag["loops"].item()) if "loops" in diag else 0, "hwm_reset": reset})
    print(json.dumps(records))


# -- memory -------------------------------------------------------------------------------------------
def bench_memory(a) -> None:
    chunks = (0, a.loss_chunk) if a.loss_chunk else (0,)
    configs = [(R, policy, c) for c in chunks for R in (10, 1) for policy in ("none", "loop", "pass")]
    res = {c: [] for c in configs}
    print(f"memory ({load()}):", flush=True)
    for r in range(a.mem_rounds):
        for R, policy, c in (configs if r % 2 == 0 else configs[::-1]):
            res[(R, policy, c)].append(run_child(a, policy, n_loops=R, loss_chunk=c)[0])
            print(f"  R={R} {policy} loss_chunk={c}: {res[(R, policy, c)][-1]['mb']:,.0f} MB", flush=True)
    med = {c: {k: statistics.median(x[k] for x in rs) for k in ("mb", "before_mb", "s")} for c, rs in res.items()}
    reset = all(x["hwm_reset"] for rs in res.values() for x in rs)
    B, T, d = a.batch, a.seq, a.d_model
    print(f"\n# peak activation memory of one training step (VmHWM after the step, {'reset' if reset else 'NOT reset'} "
          f"just before it, minus VmRSS before it; weights, gradients and AdamW moments already allocated), d={d} "
          f"P={a.prelude}, micro-batch {B} x T={T}, fresh process per configuration under glibc malloc, median of "
          f"{a.mem_rounds}. For scale: the fp32 logits [B, T, V] are {B * T * a.vocab * 4 / 2**20:,.0f} MB (the whole-"
          f"logits loss keeps them and their softmax's gradient; model.loss_chunk=N keeps none: N x V at a time), one "
          f"[B, T, d] state {B * T * d * 4 / 2**20:.1f} MB")
    print(f"{'R':>3} {'recompute':<22} {'loss':<16} {'RSS before MB':>14} {'activation MB':>14} {'x none':>7} "
          f"{'child step s':>13}")
    for (R, policy, c), m in med.items():
        label = {"pass": "pass (passes + blocks)", "loop": "loop (each core pass)"}.get(policy, policy)
        loss = f"loss_chunk={c}" if c else "whole logits"
        print(f"{R:>3} {label:<22} {loss:<16} {m['before_mb']:>14,.0f} {m['mb']:>14,.0f} "
              f"{m['mb'] / med[(R, 'none', c)]['mb']:>6.2f}x {m['s']:>13.2f}")
    print("(child step s: the measured step in its process, every large block mmapped afresh: slower than the train "
          "section's, which is the one to compare)")
    for c in chunks:
        loss = f"model.loss_chunk={c}" if c else "the whole-logits loss"
        per = {p: (med[(10, p, c)]["mb"] - med[(1, p, c)]["mb"]) / 9 for p in ("none", "loop", "pass")}
        rest = {p: med[(10, p, c)]["mb"] - 9 * per[p] for p in ("none", "loop", "pass")}
        print(f"with {loss}: per extra core pass ((R=10 - R=1) / 9) {per['none']:,.1f} MB without recompute, "
              f"{per['loop']:,.1f} MB with policy loop, {per['pass']:,.1f} MB with policy pass; the rest of the R=10 "
              f"step (prelude, anchor, coda, head, loss, one pass): {rest['none']:,.0f} MB without, "
              f"{rest['loop']:,.0f} MB with loop, {rest['pass']:,.0f} MB with pass")
        for policy in ("loop", "pass"):
            print(f"RATIO CART R=10 recompute {policy}/none activation memory, {loss} = "
                  f"{med[(10, policy, c)]['mb'] / med[(10, 'none', c)]['mb']:.2f}x (target <= 0.50x; the step-time "
                  f"ratio is the train section's RATIO line, target <= 1.40x)")
    if a.loss_chunk:
        print(f"RATIO CART R=10 recompute pass + model.loss_chunk={a.loss_chunk} / neither, activation memory = "
              f"{med[(10, 'pass', a.loss_chunk)]['mb'] / med[(10, 'none', 0)]['mb']:.2f}x")


# -- random -------------------------------------------------------------------------------------------
def random_configs(a) -> dict[str, dict]:
    configs = {"fixed R=10, full": dict(n_loops=10),
               "U{2..10}, k=2": dict(n_loops=10, loops_sampling="uniform", loops_min=2, backprop_loops=2)}
    if a.random_extra:
        configs["U{2..10}, full"] = dict(n_loops=10, loops_sampling="uniform", loops_min=2)
        configs["huginn 10, k=1"] = dict(n_loops=10, loops_sampling="huginn", backprop_loops=1)
    return configs


def bench_random(a) -> None:
    configs = random_configs(a)
    names = list(configs)
    cfgs = {n: cart_cfg(a, **kw) for n, kw in configs.items()}
    models = {n: build(cfg) for n, cfg in cfgs.items()}
    opts = {n: adamw(m) for n, m in models.items()}
    batch = batch_of(a.batch, a.seq, a.vocab)
    warm = StepContext.for_step(a.seed, WARMUP_STEP)
    for n, m in models.items():
        step(m, opts[n], batch, warm)
    times, loops = {n: [] for n in names}, {n: [] for n in names}
    print(f"random ({load()}):", flush=True)
    for i, order in rounds_of(names, a.random_steps):
        ctx = StepContext.for_step(a.seed, i)
        for n in order:
            t, R = step(models[n], opts[n], batch, ctx)
            times[n].append(t)
            loops[n].append(R)
        print(f"  step {i}: " + ", ".join(f"{n} R={loops[n][-1]} {times[n][-1] * 1e3:,.0f} ms" for n in names),
              flush=True)
    del models, opts
    mem = {}
    for n in names:
        mem[n] = run_child(a, "none", a.random_steps, **configs[n])
        print(f"  {n}: peak {max(r['mb'] for r in mem[n]):,.0f} MB", flush=True)
    ref = names[0]
    mean = {n: statistics.mean(times[n]) for n in names}
    peak = {n: max(r["mb"] for r in mem[n]) for n in names}
    print(f"\n# random depth with truncated backprop: steps 0..{a.random_steps - 1}, ctx = "
          f"StepContext.for_step({a.seed}, step) (the draw comes from the step's generator: the same R at a step for "
          f"every configuration that samples), d={a.d_model} P={a.prelude}, micro-batch {a.batch} x T={a.seq}, "
          f"{torch.get_num_threads()} thread(s); k = backprop_loops (only the last k passes get gradient); the "
          f"configurations alternate step by step ({load()})")
    print("# FLOPs: the registry's flops_per_token at each step's draw (passes without gradient count forward only), "
          "mean over the steps; peak MB: the largest one-step activation peak over the same steps in a fresh process")
    print(f"{'configuration':<18} {'R per step':<34} {'mean R':>7} {'mean ms':>8} {'median ms':>10} {'x fixed':>8} "
          f"{'FLOPs x fixed':>14} {'peak MB':>8} {'at R':>5} {'x fixed':>8}")
    f_ref = statistics.mean(mflop(cfgs[ref], a, StepContext.for_step(a.seed, i)) for i in range(a.random_steps))
    for n in names:
        f = statistics.mean(mflop(cfgs[n], a, StepContext.for_step(a.seed, i)) for i in range(a.random_steps))
        at = max(mem[n], key=lambda r: r["mb"])["loops"]
        draws = ",".join(map(str, loops[n]))
        print(f"{n:<18} {draws:<34} {statistics.mean(loops[n]):>7.1f} {mean[n] * 1e3:>8,.0f} "
              f"{statistics.median(times[n]) * 1e3:>10,.0f} {mean[n] / mean[ref]:>7.2f}x {f / f_ref:>13.2f}x "
              f"{peak[n]:>8,.0f} {at:>5} {peak[n] / peak[ref]:>7.2f}x")
    if any(loops[n] != [r["loops"] for r in mem[n]] for n in names):
        print("(the fresh processes drew other R than the timed steps: the draws do not depend only on the step)")
    for n in names[1:]:
        print(f"RATIO {n} / {ref}: mean step time = {mean[n] / mean[ref]:.2f}x (paired per step: median "
              f"{paired(times, n, ref):.2f}x), peak activation memory = {peak[n] / peak[ref]:.2f}x")


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", metavar="SECTION",
                   help=f"sections to run: all (the default) or any of {', '.join(SECTIONS)} (run in that order)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: d=256, micro-batch 1, 1 round, 3 random steps (figures imprecise)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, here and in the fresh processes (default 1)")
    p.add_argument("--d-model", type=int, default=512, help="d (H = d/64; the paper's grid: 256, 512, 768, 1024)")
    p.add_argument("--prelude", type=int, default=6, help="P, the prelude's layers (the paper's Stage 2: 6)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (the paper's Llama-2 tokenizer: 32,000)")
    p.add_argument("--seq", type=int, default=256, help="T, tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="micro-batch in sequences (every section)")
    p.add_argument("--loss-chunk", type=int, default=256,
                   help="train, memory: also with model.loss_chunk=N (the chunked loss; 0: only the whole logits)")
    p.add_argument("--rounds", type=int, default=7, help="train: alternating rounds (medians)")
    p.add_argument("--mem-rounds", type=int, default=1, help="memory: fresh processes per configuration")
    p.add_argument("--random-steps", type=int, default=8, help="random: the steps 0..N-1 every configuration runs")
    p.add_argument("--random-extra", action="store_true",
                   help="random: also uniform R with full backprop and huginn (mean 10, k=1): about +2 min")
    p.add_argument("--seed", type=int, default=0, help="the run seed of StepContext.for_step(seed, step)")
    p.add_argument("--policy", default="none", help=argparse.SUPPRESS)  # _child
    p.add_argument("--child-steps", type=int, default=1, help=argparse.SUPPRESS)  # _child
    p.add_argument("--cfg", default="{}", help=argparse.SUPPRESS)  # _child: cart_cfg keywords as JSON
    sections.run(p, SECTIONS, globals(), children={"_child": child}, quick=_quick)


def _quick(a) -> None:
    a.d_model, a.batch, a.rounds, a.mem_rounds, a.random_steps = 256, 1, 1, 1, 3


if __name__ == "__main__":
    main()
