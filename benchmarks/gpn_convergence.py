"""A small reproduction around GPN (spec-002), printed as tables, not asserted.

    PYTHONPATH=. python benchmarks/gpn_convergence.py [recall] [corpus] [--steps 250] [--out /tmp/gpn_convergence]

recall (spec §6 T10): configs/gpn/recall (associative recall: 8 pairs, then 16 queries; d=64, a memory of
4 heads of 16 x 16, batch 32, lr 3e-3) for --recall-steps steps (default 500) as GPN+M and as bare GPN at
the same width (model.mem_heads=0), through the real trainer: validation loss and query accuracy on the
same 256 held-out sequences at each evaluation. Chance is 1/32. The paper's LAMBADA accuracies (GPN+M
0.146, bare GPN 0.015) are this gap at scale.

corpus: GPN+M (configs/gpn/tiny: d=128, E=64, F=256, a memory of 4 heads of 16 x 32, T=128) against the
Transformer++ baseline with the stored parameter count closest to it (configs/baseline/tiny at d=64,
2 heads, the layer count chosen here; both counts printed), on the embedded quickstart corpus with the
same steps, seed, data order, optimizer and schedule (gpn/tiny's) (benchmarks/convergence.py's compare): validation loss
against the step and against training FLOPs. The paper (130M, 2.6B tokens) has 1-layer GPN+M at
18.06 perplexity against the Transformer++'s 16.05 (+13%).

Takes about 10-20 minutes on 2 busy cores at the defaults. The same two grids as a recipe, run and reported
through the run database: configs/gpn/papers/cpu-recall-and-corpus.yaml (`pretrain repro ... --local`, then
`--report`); this script adds the query-accuracy table and picks the Transformer's depth by parameter count.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from convergence import add_arguments, compare, train  # noqa: E402  (benchmarks/)
from pretrain.config import load_config  # noqa: E402
from pretrain.models import count_parameters, get_arch  # noqa: E402

SECTIONS = ("recall", "corpus")


def stored(config: str, extra: list[str]) -> int:
    cfg = load_config(config, extra, check_data=False).model
    with torch.device("meta"):
        return count_parameters(get_arch(cfg.arch).build(cfg))["total"]


def bench_recall(a) -> None:
    steps = a.steps
    a.steps = a.recall_steps
    results = {name: train("gpn/recall", f"recall-{name}", a, extra) for name, extra in
               (("gpn+m", []), ("gpn", ["model.mem_heads=0"]))}
    a.steps = steps
    print(f"# associative recall (configs/gpn/recall), {a.recall_steps} steps; validation on 256 held-out sequences "
          "(chance accuracy 1/32)")
    print(f"{'step':>6} {'GPN+M loss':>11} {'GPN+M acc':>10} {'GPN loss':>9} {'GPN acc':>8}")
    by = {n: {r["step"]: r for r in results[n][0]} for n in results}
    for step in sorted(by["gpn+m"]):
        m, g = by["gpn+m"][step], by["gpn"].get(step, {})
        print(f"{step:>6} {m['val_loss']:>11.4f} {m.get('val_acc_query', float('nan')):>10.3f} "
              f"{g.get('val_loss', float('nan')):>9.4f} {g.get('val_acc_query', float('nan')):>8.3f}")
    for n in results:
        print(f"{n}: {stored('gpn/recall', [] if n == 'gpn+m' else ['model.mem_heads=0']):,} parameters, "
              f"{results[n][2]:.0f} s")


def bench_corpus(a) -> None:
    target = stored("gpn/tiny", [])
    # the same optimizer and schedule as gpn/tiny's
    recipe = ["optim.lr=3e-3", "optim.min_lr=3e-4", "optim.weight_decay=0.1", "optim.beta1=0.9", "optim.beta2=0.95",
              "optim.grad_clip=1.0", "schedule.kind=cosine"]
    base = ["model.d_model=64", "model.n_heads=2", "data.seq_len=128", *recipe]
    L = min(range(1, 33), key=lambda n: abs(stored("baseline/tiny", base + [f"model.n_layers={n}"]) - target))
    runs = {"transformer": ("baseline/tiny", base + [f"model.n_layers={L}"]), "gpn+m": ("gpn/tiny", [])}
    print(f"# stored parameters: GPN+M (gpn/tiny) {target:,}; Transformer++ d=64 {L} layers "
          f"{stored('baseline/tiny', runs['transformer'][1]):,}")
    compare(runs, a, f"{a.steps} steps of 16 x 128 tokens on data/quickstart: a Transformer++ of {L} layers at d=64 "
                     "against GPN+M d=128 (state) with a 4-head memory")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: both)")
    add_arguments(p, "/tmp/gpn_convergence")
    p.add_argument("--recall-steps", type=int, default=500)
    a = p.parse_args()
    bad = [w for w in a.what if w not in SECTIONS]
    if bad:
        p.error(f"unknown section {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    sections = a.what or SECTIONS
    runs = {"recall": ("recall-gpn+m", "recall-gpn"), "corpus": ("gpn+m", "transformer")}
    there = [f"{a.out}/{n}" for s in sections for n in runs[s] if os.path.exists(f"{a.out}/{n}")]
    if there:
        raise SystemExit(f"{', '.join(there)} exist: the trainer would resume them; remove them or pass another --out")
    for section in sections:
        globals()[f"bench_{section}"](a)


if __name__ == "__main__":
    main()
