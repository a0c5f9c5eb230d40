"""A small reproduction around CART (spec-004), printed as tables, not asserted: CART against the Dense
baseline of the same stored parameters, the trained CART at other loop counts R', and spec §6.5's
leak-collapse experiment.

    PYTHONPATH=. python benchmarks/cart_convergence.py [--steps 250] [--out /tmp/cart_convergence]
    PYTHONPATH=. python benchmarks/cart_convergence.py leak --leak-steps 1000   # just the leak experiment
    PYTHONPATH=. python benchmarks/cart_convergence.py --data /elsewhere/data/quickstart   # the corpus elsewhere

compare: CART (configs/cart/tiny: d=128, 2 heads, P=2 prelude layers, R=4 core passes, one coda layer,
vocab 4,096, T=256, batch 16) and the Dense baseline of the same width (the same config with
model.dense=true: full-rank self-attention layers, no loop machinery, spec §2.11) with the layer count
whose stored parameters are closest to CART's (both counts printed, from the formula and counted),
trained through the real trainer (benchmarks/convergence.py's compare) on the embedded quickstart
corpus with the same steps, seed, data order and schedule: validation loss of each at each evaluation,
against the step and against the training FLOPs spent (a CART step at R=4 costs more than the Dense
one). The paper (d=1024, 1B tokens) has CART 1-2% behind its stored-parameter Dense 7L.

sweep: the trained CART's validation loss at R' in --loops (default 1,2,4,6,8,12,16) on the same weights,
through `pretrain eval RUN --sweep model.n_loops=... --json` (pretrain.cli.main), beside the trained R
and the Dense run. The paper: running more loops at inference than in training hurts.

leak: spec §6.5. i.i.d. uniform tokens over V=64 (entropy ln 64 = 4.159 nats), fresh tokens every step
(the same stream for both runs), CART d=64, n_heads=1, P=3, R=4, T=32, B=16, AdamW lr 3e-3 (betas
0.9/0.95, weight decay 0.1 on every parameter, clipping at 1.0 as in the paper's recipe, no schedule),
--leak-steps steps (default 300), a plain loop, not the trainer. Once with the causal core
cross-attention, once non-causal: CoreBlock.forward gets the Attend with its mask replaced by
kernels.attention.full() (the pre-fix code, which let h[t] read the anchor at t+1, the next token).
Printed: the loss averaged over windows of 50 steps, and the mean over the last 50 steps of each run.
The paper saw a collapse at ~1,750 steps on real data; spec §8.1 found none at 300 or 600 steps here.
--leak-steps 1000 (about 1.5 minutes more) shows where the non-causal run goes after the 300.
Before training, a direct check at init (spec §6.4): changing the tokens after position t changes
logits at <= t only in the non-causal model.

Runs take about 10-15 minutes on 2 busy cores at the defaults (the two trainings most of it). The compare
and sweep sections as a recipe, run and reported through the run database:
configs/cart/papers/cpu-cart-vs-dense.yaml (`pretrain repro ... --local`, then `--report`); this script adds
the parameter-matched Dense depth and the leak experiment.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402

from bench_crt import batch_of  # noqa: E402  (benchmarks/: uniform ids over the whole vocabulary)
from convergence import add_arguments, compare  # noqa: E402  (benchmarks/)
from kernels.attention import full  # noqa: E402
from pretrain import cli  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.models.base import StepContext  # noqa: E402
from pretrain.models.cart import CART, CARTConfig, parameter_counts  # noqa: E402
from pretrain.models.registry import count_parameters  # noqa: E402

SECTIONS = ("compare", "sweep", "leak")
CONFIG = "cart/tiny"


# -- compare ------------------------------------------------------------------------------------------
def data_overrides(a) -> list[str]:
    """The corpus's paths when --data names another folder (its cache then under --out)."""
    if a.data is None:
        if not os.path.exists("data/quickstart/train_text_document.bin"):
            raise SystemExit("data/quickstart is missing here: run quickstart.sh (it builds the embedded corpus) or "
                             "pass --data FOLDER, a folder holding train_text_document, valid_text_document and tok/")
        return []
    d = os.path.abspath(a.data)
    return [f"data.train=[{d}/train_text_document]", f"data.valid=[{d}/valid_text_document]",
            f"data.tokenizer={d}/tok/spm.model", f"data.cache_dir={os.path.abspath(a.out)}/cache"]


def counted(cfg: CARTConfig) -> int:
    with torch.device("meta"):
        return count_parameters(CART(cfg))["total"]


def dense_layers(cfg: CARTConfig) -> int:
    """The Dense baseline's L at cfg's width: the layer count whose stored parameters are closest to CART's."""
    target = parameter_counts(cfg)["stored"]
    return min(range(1, 65),
               key=lambda L: abs(parameter_counts(replace(cfg, dense=True, n_layers=L))["stored"] - target))


def runs(a) -> dict[str, tuple[str, list[str]]]:
    cfg = load_config(CONFIG, data_overrides(a)).model
    L = dense_layers(cfg)
    return {"dense": (CONFIG, ["model.dense=true", f"model.n_layers={L}", *data_overrides(a)]),
            "cart": (CONFIG, data_overrides(a))}


def bench_compare(a) -> None:
    the_runs = runs(a)
    there = [f"{a.out}/{n}" for n in the_runs if os.path.exists(f"{a.out}/{n}")]
    if there:
        raise SystemExit(f"{', '.join(there)} exist: the trainer would resume them; remove them or pass another --out")
    cfgs = {n: load_config(c, extra).model for n, (c, extra) in the_runs.items()}
    cart = cfgs["cart"]
    print(f"# the models ({CONFIG}: d={cart.d_model}, {cart.n_heads} heads, FFN {cart.ffn}, vocab {cart.vocab_size}); "
          f"the Dense baseline: model.dense=true with the layer count closest in stored parameters")
    print(f"{'run':<6} {'what':<28} {'stored (formula)':>17} {'stored (counted)':>17} {'effective':>11} "
          f"{'x dense stored':>15}")
    ref = parameter_counts(cfgs["dense"])["stored"]
    for n, cfg in cfgs.items():
        what = (f"Dense {cfg.n_layers}L" if cfg.dense else
                f"CART P={cfg.n_layers} R={cfg.n_loops} (+1 coda layer)")
        c = parameter_counts(cfg)
        print(f"{n:<6} {what:<28} {c['stored']:>17,} {counted(cfg):>17,} {c['effective']:>11,} "
              f"{c['stored'] / ref:>14.3f}x")
    print(flush=True)
    compare(the_runs, a, f"{a.steps} steps of 16 x 256 tokens on data/quickstart, d={cart.d_model}: Dense "
                         f"{cfgs['dense'].n_layers}L (dense) against CART P={cart.n_layers} R={cart.n_loops} (cart), "
                         f"seed {a.seed}")


# -- sweep --------------------------------------------------------------------------------------------
def pretrain_json(argv: list[str]):
    """`pretrain ARGV` in this process; its last stdout line as JSON."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = cli.main(argv)
    if rc:
        raise SystemExit(f"pretrain {' '.join(argv)} exited {rc}:\n{buffer.getvalue()[-2000:]}")
    return json.loads(buffer.getvalue().strip().splitlines()[-1])


def bench_sweep(a) -> None:
    run, dense = f"{a.out}/cart", f"{a.out}/dense"
    if not os.path.isdir(run):
        raise SystemExit(f"{run} is missing: run the compare section first (same --out)")
    trained = load_config(CONFIG, data_overrides(a)).model.n_loops
    t0 = time.time()
    rows = pretrain_json(["eval", run, "--sweep", "model.n_loops=" + ",".join(map(str, a.loops)), "--json",
                          "--batches", str(a.eval_batches)])
    base = pretrain_json(["eval", dense, "--json", "--batches", str(a.eval_batches)]) if os.path.isdir(dense) else None
    at = {int(r["model.n_loops"]): r["val_loss"] for r in rows}
    ref = at.get(trained)
    print(f"\n# the trained CART (R={trained} in training) evaluated at R' on the same weights and the same "
          f"{a.eval_batches} validation batches: pretrain eval {run} --sweep model.n_loops="
          f"{','.join(map(str, a.loops))} --json ({time.time() - t0:.0f} s)")
    print(f"{'R_prime':>7} {'val loss':>9} {'perplexity':>11} {'d vs R=' + str(trained):>11} {'d vs dense':>11}")
    for r in rows:
        R, loss = int(r["model.n_loops"]), r["val_loss"]
        d_ref = f"{loss - ref:+.4f}" if ref is not None else "-"
        d_dense = f"{loss - base['val_loss']:+.4f}" if base else "-"
        print(f"{R:>7} {loss:>9.4f} {math.exp(loss):>11.2f} {d_ref:>11} {d_dense:>11}")
    if base:
        print(f"{'dense':>7} {base['val_loss']:>9.4f} {math.exp(base['val_loss']):>11.2f}")
    best = min(at, key=at.get)
    print(f"best R' = {best} ({at[best]:.4f}); R'={trained} (trained) {at.get(trained, float('nan')):.4f}")


# -- leak ---------------------------------------------------------------------------------------------
LEAK_V, LEAK_T, LEAK_B = 64, 32, 16


def non_causal(core) -> None:
    """The core cross-attention without its causal mask (the pre-fix code): h[t] reads every anchor position."""
    inner = core.forward

    def forward(h, k, v, at, offset):
        return inner(h, k, v, type(at)(full(), at.rope, at.cache, at.slot), offset)

    core.forward = forward


def leak_model(causal: bool, seed: int) -> CART:
    torch.manual_seed(seed)
    model = CART(CARTConfig(vocab_size=LEAK_V, d_model=64, n_heads=1, n_layers=3, n_loops=4, max_seq_len=LEAK_T))
    if not causal:
        non_causal(model.core)
    return model


def leak_check(a) -> dict[str, float]:
    """At init: the largest change of logits at positions <= t when only the tokens after t change."""
    t = LEAK_T // 2
    tokens = batch_of(2, LEAK_T, LEAK_V, seed=a.seed).tokens
    later = tokens.clone()
    later[:, t + 1:] = (later[:, t + 1:] + 5) % LEAK_V
    out = {}
    for name, causal in (("causal", True), ("non-causal", False)):
        model = leak_model(causal, a.seed).eval()
        with torch.no_grad():
            out[name] = (model.logits(tokens)[:, :t + 1] - model.logits(later)[:, :t + 1]).abs().max().item()
    return out


def leak_run(causal: bool, a) -> tuple[list[float], float]:
    model = leak_model(causal, a.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.leak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    t0 = time.perf_counter()
    for step in range(a.leak_steps):
        batch = batch_of(LEAK_B, LEAK_T, LEAK_V, seed=1_000_000 + a.seed * 100_000 + step)  # fresh, same stream
        loss, _ = model(batch, StepContext.for_step(a.seed, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def bench_leak(a) -> None:
    entropy = math.log(LEAK_V)
    check = leak_check(a)
    res = {"causal": leak_run(True, a), "non-causal": leak_run(False, a)}
    print(f"\n# spec §6.5 leak collapse: i.i.d. uniform tokens over V={LEAK_V} (entropy ln {LEAK_V} = {entropy:.4f} "
          f"nats), fresh every step (the same stream for both), CART d=64 H=1 P=3 R=4, T={LEAK_T}, B={LEAK_B}, AdamW "
          f"lr {a.leak_lr:g} (0.9, 0.95), wd 0.1, clip 1.0, {a.leak_steps} steps, seed {a.seed}; the non-causal run's "
          f"core cross-attention gets the mask kernels.attention.full()")
    t = LEAK_T // 2
    print(f"at init, max |logits[:, :{t + 1}] change| when only tokens after position {t} change: causal "
          f"{check['causal']:.1e}, non-causal {check['non-causal']:.1e}")
    print(f"{'steps':>11} {'causal':>9} {'non-causal':>11} {'nc - causal':>12}")
    for lo in range(0, a.leak_steps, 50):
        hi = min(lo + 50, a.leak_steps)
        c, n = (statistics.mean(res[k][0][lo:hi]) for k in ("causal", "non-causal"))
        print(f"{f'{lo + 1}-{hi}':>11} {c:>9.4f} {n:>11.4f} {n - c:>+12.4f}")
    last = {k: statistics.mean(v[0][-50:]) for k, v in res.items()}
    low = {k: min(v[0]) for k, v in res.items()}
    for k in res:
        print(f"{k:<11} mean over the last 50 steps {last[k]:.4f} ({last[k] - entropy:+.4f} vs ln {LEAK_V}), lowest "
              f"single step {low[k]:.4f}, {res[k][1]:.0f} s")
    gap = last["non-causal"] - last["causal"]
    print(f"RATIO leak: non-causal - causal mean loss over the last 50 steps = {gap:+.4f} nats (a collapse "
          "would be well below 0; spec §8.1 saw 4.149 vs 4.162 at 300 steps)")


# -- main ---------------------------------------------------------------------------------------------
def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", metavar="SECTION",
                   help=f"sections to run: all (the default) or any of {', '.join(SECTIONS)}, in that order (sweep "
                   "reads the compare section's run under --out)")
    add_arguments(p, "/tmp/cart_convergence")
    p.add_argument("--data", default=None,
                   help="the quickstart corpus's folder (default: the config's data/quickstart, relative to here)")
    p.add_argument("--loops", type=ints, default=[1, 2, 4, 6, 8, 12, 16], help="sweep: the R' values")
    p.add_argument("--leak-steps", type=int, default=300, help="leak: steps of each run")
    p.add_argument("--leak-lr", type=float, default=3e-3, help="leak: AdamW's learning rate")
    a = p.parse_args()
    a.what = a.what or ["all"]
    bad = [w for w in a.what if w not in ("all", *SECTIONS)]
    if bad:
        p.error(f"unknown section {', '.join(bad)}; choose from all, {', '.join(SECTIONS)}")
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    for section in (SECTIONS if "all" in a.what else [s for s in SECTIONS if s in a.what]):
        globals()[f"bench_{section}"](a)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
