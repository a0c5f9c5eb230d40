"""Export and load time and peak memory of baseline/xs (53M parameters), each in a fresh process.

    PYTHONPATH=. python benchmarks/bench_export.py [--config baseline/xs] [--out /tmp/bench_export]

Trains the config one step on a synthetic corpus (so the checkpoint holds optimizer state too, as a
real one does), then, each in its own process: `pretrain export` (native), `pretrain export --format
hf`, load_folder() of the native folder, and load_for_inference() of the run for comparison. Memory
is the process's peak RSS (VmHWM) above its RSS once torch and the code are imported, in units of
the weights' size: export must stay under 2.0 (the loaded checkpoint plus at most one more copy).
Pages of a memory-mapped file that is read count as resident too (load_folder maps the folder).

--weights-only: no training step; the model is built and saved as a weights-only checkpoint (as
`pretrain import` writes one), for configs whose optimizer state does not fit this machine (sps/xl,
1.68B parameters: 27 GB for weights, gradients and Adam). The export reads the weights alone either way.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MEASURE = """
import json, sys, time
import torch
from pretrain.export.writer import export
from pretrain.export.loader import load_folder
from pretrain.generate import load_for_inference
import pretrain.models, pretrain.checkpoint, safetensors.torch
pretrain.models.all_archs()
from procmem import status_kib
def status_mb(key):
    return status_kib(key) / 1024
start = status_mb("VmRSS")
t0 = time.perf_counter()
what, a, b = sys.argv[1:4]
if what == "export":
    export(a, b, force=True, log=lambda *_: None)
elif what == "export_hf":
    export(a, b, fmt="hf", force=True, log=lambda *_: None)
elif what == "load_folder":
    model = load_folder(a, log=lambda *_: None)[0]
else:
    model = load_for_inference(a, log=lambda *_: None)[0]
seconds = time.perf_counter() - t0
peak = status_mb("VmHWM")
print(json.dumps({"seconds": seconds, "start_mb": start, "peak_mb": peak}))
"""


def run(*args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))  # HERE: procmem
    out = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def save_weights(cfg, run_dir: str) -> None:
    """The model of `cfg` as built, saved as a weights-only checkpoint of step 0 with its config."""
    from pretrain.checkpoint import SavedModel, save_checkpoint
    from pretrain.config import to_yaml
    from pretrain.models import get_arch

    saved = SavedModel()
    saved.state = get_arch(cfg.model.arch).build(cfg.model).state_dict()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    save_checkpoint(run_dir, 0, saved, None, {"consumed_samples": 0, "config": cfg.to_dict(), "tokenizer": None})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="baseline/xs")
    p.add_argument("--out", default="/tmp/bench_export")
    p.add_argument("--weights-only", action="store_true", help="save the built model without a training step")
    p.add_argument("overrides", nargs="*", help="config overrides (sps/xl: schedule.total_tokens=0)")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from pretrain.config import load_config
    from pretrain.trainer import Trainer
    from trainer_helpers import write_markov_corpus

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    corpus = write_markov_corpus(os.path.join(args.out, "markov"))
    run_dir = os.path.join(args.out, "run")
    over = [f"data.train=[{corpus}]", "data.valid=[]", "data.split=90,10", "data.tokenizer=''", "data.seq_len=64",
            f"data.cache_dir={args.out}/cache", "data.num_workers=0", f"train.run_dir={run_dir}", "train.max_steps=1",
            "train.global_batch_seqs=2", "train.micro_batch_seqs=2", "train.compile=false", "train.eval_every=0",
            "checkpoint.every=1", "schedule.warmup_steps=0", "log.peak_tflops=1.0"]
    cfg = load_config(args.config, over + args.overrides)
    if args.weights_only:
        save_weights(cfg, run_dir)
    else:
        Trainer(cfg, log=lambda *_: None).fit()
    ckpt = os.path.join(run_dir, "checkpoints")
    ckpt_mb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ckpt) for f in fs) / 2**20
    native, hf = os.path.join(args.out, "native"), os.path.join(args.out, "hf")
    rows = [("export (native)", run("export", run_dir, native)), ("export --format hf", run("export_hf", run_dir, hf)),
            ("load_folder (native)", run("load_folder", native, "-")),
            ("load_for_inference (run)", run("load_run", run_dir, "-"))]
    weights_mb = os.path.getsize(os.path.join(native, "model.safetensors")) / 2**20
    kind = "weights only" if args.weights_only else "with optimizer state"
    print(f"# {args.config}: weights {weights_mb:.1f} MiB (fp32); checkpoint ({kind}) {ckpt_mb:.1f} MiB")
    print(f"{'':28s} {'seconds':>8s} {'peak RSS above start (MiB)':>27s} {'in weights':>11s}")
    for name, r in rows:
        extra = r["peak_mb"] - r["start_mb"]
        print(f"{name:28s} {r['seconds']:8.2f} {extra:27.1f} {extra / weights_mb:10.2f}x")


if __name__ == "__main__":
    main()
