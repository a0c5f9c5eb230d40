"""A micro batch's peak activation memory, measured on the CPU, beside the planner's estimate.

    PYTHONPATH=. python benchmarks/activation_peak.py rt/300m-12l --batches 4,8
    PYTHONPATH=. python benchmarks/activation_peak.py rt/300m-12l --batches 4,8 model.n_layers=2 --fp32

One forward and backward of the config's model per batch size (random tokens, the config's sequence length),
under CPU bf16 autocast (a stand-in for CUDA's; --fp32: none), with every tensor storage an op creates
counted from its creation until it is freed (tests/live_memory.py); the parameters and their gradients are
left out, as the planner counts them apart. The peak grows linearly in the batch, so two batches give its
slope, and the line is carried to the config's micro batch: what a GPU would need for activations before
it is tried there (the RT 512 x 512 run of 2026-11-29 ran out of an H200's memory in its first step). The
planner's figure is pretrain/plan.py's (the registry's activation_bytes, bf16_activations under autocast).
Each row names the code running at its peak: a line carried between peaks in different places (a small
batch's peak in the loss, a larger one's in a layer's backward) is not one peak's growth, and a note says so.
A full-size model runs slowly here (rt/300m-12l: about 3 minutes a batch of 8 sequences on one core).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from live_memory import step_peak  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.models import get_arch  # noqa: E402
from pretrain.plan import bf16_activations  # noqa: E402

GIB = 2 ** 30


def peak(model, vocab: int, B: int, T: int, bf16: bool) -> tuple[int, str]:
    """Live bytes at the worst moment of one forward and backward of B random sequences of T tokens, and the
    code running then (file:function:line)."""
    tokens = torch.randint(5, vocab, (B, T), generator=torch.Generator().manual_seed(B))
    where: list[str] = []
    return step_peak(model, tokens, bf16, where), where[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("config", help="a shipped config's short name (e.g. rt/300m-12l) or a YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=2")
    ap.add_argument("--batches", default="4,8", help="two or more micro batch sizes to measure (default 4,8)")
    ap.add_argument("--fp32", action="store_true", help="no autocast (the planner's fp32 figure beside it)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_intermixed_args(argv)  # overrides may come after options, as the examples above
    batches = sorted({int(b) for b in a.batches.split(",")})
    if len(batches) < 2 or batches[0] < 1:
        ap.error(f"--batches needs two or more sizes >= 1, got {a.batches!r}")
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config, a.overrides, check_data=False)
    spec = get_arch(cfg.model.arch)
    if spec.activation_bytes is None:
        ap.error(f"model.arch {cfg.model.arch!r} has no activation_bytes estimate in its registry")
    torch.manual_seed(0)
    model = spec.build(cfg.model).train()
    if cfg.parallel.recompute != "none":  # the config's policy, as the trainer applies it (GPN's segments)
        spec.recompute_policies()[cfg.parallel.recompute].apply(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the backward adds into them, as in training
    T, policy, bf16 = cfg.data.seq_len, cfg.parallel.recompute, not a.fp32

    def planner(B: int) -> float:
        fp32 = spec.activation_bytes(cfg.model, T, B, policy)
        return bf16_activations(cfg.model, fp32, B * T, spec.bf16_kept(policy)) if bf16 else fp32

    print(f"{a.config} {' '.join(a.overrides)}: {cfg.model.arch}, T {T}, {'bf16 autocast' if bf16 else 'fp32'}, "
          f"recompute {policy}; parameters and gradients left out")
    chunk = getattr(cfg.model, "loss_chunk", 0)
    if chunk and chunk >= batches[0] * T:
        print(f"note: model.loss_chunk={chunk} is not below the smallest batch's {batches[0] * T} positions: where "
              "the loss is the peak, that peak stops growing once the batch passes the chunk, and the line carried "
              f"from these batches is not the config's; add model.loss_chunk={batches[0] * T // 4} to measure the rest")
    print(f"{'micro batch':>11} {'measured GiB':>12} {'planner GiB':>11} {'planner/measured':>16} {'seconds':>8}  "
          "peak in")
    got, at_code = {}, {}
    for B in batches:
        t0 = time.perf_counter()
        got[B], at_code[B] = peak(model, cfg.model.vocab_size, B, T, bf16)
        print(f"{B:>11} {got[B] / GIB:>12.3f} {planner(B) / GIB:>11.3f} {planner(B) / got[B]:>16.2f} "
              f"{time.perf_counter() - t0:>8.0f}  {at_code[B]}", flush=True)
    lo, hi = batches[0], batches[-1]
    if at_code[lo].rsplit(":", 1)[0] != at_code[hi].rsplit(":", 1)[0]:
        print(f"note: the peaks of batches {lo} and {hi} are in different code, so the line between them is not one "
              "peak's growth per sequence; measure larger batches, whose peaks are in the same place")
    slope = (got[hi] - got[lo]) / (hi - lo)
    mb = cfg.train.micro_batch_seqs
    at = got[hi] + slope * (mb - hi)
    print(f"per sequence {slope / GIB:.4f} GiB; at the config's micro batch {mb}: {at / GIB:.1f} GiB carried "
          f"along the line, the planner {planner(mb) / GIB:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
