"""spec-000 §6.9's tiny convergence check, printed as a table (not a test: the figures are soft targets).

    PYTHONPATH=. python benchmarks/crt_convergence.py [--steps 800] [--out /tmp/crt_convergence]

Trains, on byte-level text that every machine has (the Python standard library's own sources, as
bytes; nothing is downloaded), a CRT D=1
C=64 with K ~ U{2..5}, the same with K fixed at 5 (no k_min), and a roformer N=1, all through the
real trainer (T=64, batch 32, lr 1e-3). Then evaluates each CRT on the same held-out windows at
K = 1, 2, 3, 5, 10 and exactly (streaming, eval_k=-1), with the contraction estimate L̂ at K=5.
The spec expects PPL(K=1) >> PPL(K=3) >= PPL(K=5) ~ PPL(K=10) ~ Seq, L̂ < 1 with k_min and larger
without. The same three runs and K evaluations as a recipe on the quickstart corpus instead of bytes, run
and reported through the run database: configs/crt/papers/cpu-k-sweep.yaml (`pretrain repro ... --local`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from pretrain.config import load_config  # noqa: E402
from pretrain.generate import load_for_inference  # noqa: E402
from pretrain.trainer import Trainer, collator_for, evaluate_loss  # noqa: E402
import numpy as np  # noqa: E402

from data_tools.indexed import IndexedWriter  # noqa: E402

VOCAB, EOD = 264, 2  # bytes as ids 3..258


def write_byte_corpus(prefix, max_bytes=4_000_000):
    """The standard library's .py files as byte-level documents (ids = byte + 3, EOD between files)."""
    root, total = os.path.dirname(os.__file__), 0
    with IndexedWriter(prefix, np.uint16) as w:
        for name in sorted(os.listdir(root)):
            if name.endswith(".py") and total < max_bytes:
                data = np.frombuffer(open(os.path.join(root, name), "rb").read(), dtype=np.uint8)
                total += len(data)
                w.add_document(np.concatenate([data.astype(np.uint16) + 3, [EOD]]))
    return str(prefix)


def overrides(out, corpus, name, steps):
    values = {"model.vocab_size": VOCAB, "model.d_model": 64, "model.n_layers": 1, "model.n_heads": 4,
              "model.max_seq_len": 64, "data.train": f"[{corpus}]", "data.valid": "[]", "data.split": "90,10",
              "data.tokenizer": "''", "data.seq_len": 64, "data.num_workers": 0, "data.cache_dir": f"{out}/cache",
              "train.run_dir": f"{out}/{name}", "train.max_steps": steps, "train.global_batch_seqs": 32,
              "train.micro_batch_seqs": 32, "train.log_every": 100, "train.eval_every": 0, "train.eval_batches": 8,
              "train.compile": "false", "optim.lr": 1e-3, "optim.min_lr": 1e-4, "schedule.warmup_steps": min(50, steps // 4),
              "checkpoint.every": steps, "log.peak_tflops": 1.0}
    return [f"{k}={v}" for k, v in values.items()]


def evaluate(run_dir, eval_k):
    from pretrain.data.build import valid_dataset

    model, _, cfg, _ = load_for_inference(run_dir, overrides=[f"model.eval_k={eval_k}"], need=("eval",),
                                          log=lambda *_: None)
    data, n = valid_dataset(cfg.data)
    return evaluate_loss(model, data, min(8 * 32, n), 32, collator_for(cfg.data), "cpu")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--out", default="/tmp/crt_convergence")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    corpus = write_byte_corpus(os.path.join(a.out, "stdlib"))
    runs = {"CRT D=1 K~U{2..5}": ["model.k_max=5", "model.k_min=2"],
            "CRT D=1 K=5 fixed": ["model.k_max=5", "model.k_min=0"],
            "roformer N=1": ["model.correction=none", "model.k_max=1", "model.k_min=0"]}
    for i, (name, extra) in enumerate(runs.items()):
        cfg = load_config("crt/tiny", overrides(a.out, corpus, f"run{i}", a.steps) + extra)
        Trainer(cfg, log=lambda *_: None).fit()
    print(f"# {a.steps} steps, T=64, batch 32, C=64, 4 heads; validation perplexity on the same held-out windows")
    print(f"{'model':<20} {'K=1':>8} {'K=2':>8} {'K=3':>8} {'K=5':>8} {'K=10':>8} {'Seq':>8} {'|Seq-K10|':>10} "
          f"{'L̂ max':>7} {'L̂ med':>7}")
    for i, name in enumerate(runs):
        run = f"{a.out}/run{i}"
        if name.startswith("roformer"):
            ppl = math.exp(evaluate(run, 0)["val_loss"])
            print(f"{name:<20} {ppl:>8.2f}")
            continue
        res = {k: evaluate(run, k) for k in (1, 2, 3, 5, 10, -1)}
        ppl = {k: math.exp(r["val_loss"]) for k, r in res.items()}
        gap = abs(ppl[-1] - ppl[10]) / ppl[10]
        print(f"{name:<20} " + " ".join(f"{ppl[k]:>8.2f}" for k in (1, 2, 3, 5, 10, -1))
              + f" {gap:>9.2%} {res[5]['val_lhat_max']:>7.2f} {res[5]['val_lhat_median']:>7.2f}")


if __name__ == "__main__":
    main()
