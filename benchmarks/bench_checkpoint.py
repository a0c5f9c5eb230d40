"""What checkpoint checksums cost: save and load time of a baseline/xs checkpoint (53M parameters
with AdamW state, ~740 MB) with and without them, side by side.

    PYTHONPATH=. python benchmarks/bench_checkpoint.py [--rounds 3] [--dir /tmp]

Each round saves one checkpoint with checksums (xxh3-128 of every file, read back after DCP's
fsynced write) and one without, then loads each (verifying, and not), alternating the order, into
a fresh model and optimizer (os.sync() before each save, so that one save's writeback is not timed
in the next). The files were just written, so loads read from the page cache: the
figures are the CPU cost of verification, the best case for a first read from a parallel
filesystem. Also printed: the raw hashing speed. Medians over the rounds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pretrain.checkpoint import file_checksum, load_checkpoint, save_checkpoint  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.models import get_arch  # noqa: E402
from pretrain.optim import build_optimizer  # noqa: E402


def model_and_optimizer(cfg, seed: int):
    torch.manual_seed(seed)
    model = get_arch(cfg.model.arch).build(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    for p in model.parameters():  # one step creates Adam's moments (the state a real checkpoint holds)
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    cfg = load_config("baseline/xs", check_data=False)
    model, opt = model_and_optimizer(cfg, 0)
    fresh, fresh_opt = model_and_optimizer(cfg, 1)
    meta = {"config": cfg.to_dict(), "consumed_samples": 0}
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    times: dict[str, list[float]] = {k: [] for k in ("save", "save+checksums", "load", "load+verify")}
    try:
        save_checkpoint(os.path.join(root, "warm-up"), 0, model, opt, meta)  # DCP's first call sets itself up
        shutil.rmtree(os.path.join(root, "warm-up"))
        size = 0
        for r in range(args.rounds):
            for checksums in ((True, False) if r % 2 == 0 else (False, True)):
                run = os.path.join(root, "with" if checksums else "without")
                os.sync()  # the previous save's writeback must not land on this one's fsyncs
                t0 = time.perf_counter()
                path = save_checkpoint(run, r, model, opt, meta, keep_last=1, checksums=checksums)
                times["save+checksums" if checksums else "save"].append(time.perf_counter() - t0)
                size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
                t0 = time.perf_counter()
                load_checkpoint(path, fresh, fresh_opt, verify=checksums, log=lambda _: None)
                times["load+verify" if checksums else "load"].append(time.perf_counter() - t0)
        biggest = max((os.path.join(path, n) for n in os.listdir(path)), key=os.path.getsize)
        t0 = time.perf_counter()
        file_checksum(biggest)
        rate = os.path.getsize(biggest) / (time.perf_counter() - t0) / 1e9
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"baseline/xs checkpoint: {size / 1e6:,.0f} MB (weights + AdamW moments), {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads; xxh3-128 hashes a page-cached file at {rate:.1f} GB/s")
    print(f"{'':8s} {'without':>9s} {'with':>9s} {'ratio':>7s}")
    for what, plain, checked in (("save", "save", "save+checksums"), ("load", "load", "load+verify")):
        print(f"{what:8s} {med[plain]:8.2f}s {med[checked]:8.2f}s {med[checked] / med[plain]:6.2f}x   (each round: "
              f"{' '.join(f'{t:.2f}' for t in times[plain])} / {' '.join(f'{t:.2f}' for t in times[checked])})")


if __name__ == "__main__":
    main()
