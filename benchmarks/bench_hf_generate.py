"""Greedy generation at batch 1 on the CPU: transformers' `generate` on the exported folder against
`pretrain generate` (pretrain.generate.generate) on the same weights, for every architecture.

    PYTHONPATH=.:tests python benchmarks/bench_hf_generate.py [--arch rt] [--new 96] [--threads 1]

Each architecture's tiny config is built (random weights), saved as a weights-only checkpoint and
exported with --format hf; both decoders then continue a 16-token prompt by --new tokens, twice each,
alternating, and the faster run of each counts. Per token: tokens/s, and the growth of a step's cost
with the position (the mean time of the last quarter of the steps over the first quarter's): a
recurrent state keeps it flat where a KV cache lets it grow. The greedy tokens must be equal.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def folder_of(arch: str, tmp: str) -> str:
    """A --format hf folder of the architecture's tiny config (random weights)."""
    sys.path.insert(0, HERE)
    from bench_export import save_weights
    from pretrain.config import load_config
    from pretrain.export.writer import export

    run = os.path.join(tmp, arch, "run")
    cfg = load_config(f"{arch}/tiny", ["data.tokenizer=''", "data.task=''", f"train.run_dir={run}"],
                      check_data=False, log=lambda *_: None)
    save_weights(cfg, run)
    out = os.path.join(tmp, arch, "hf")
    export(run, out, fmt="hf", log=lambda *_: None)
    return run, out


def timed_steps(fn):
    """fn wrapped to record the time of each call."""
    stamps = []

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        stamps.append(time.perf_counter())
        return out
    return wrapped, stamps


def growth(stamps: list[float]) -> float:
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    q = max(1, len(steps) // 4)
    return (sum(steps[-q:]) / q) / (sum(steps[:q]) / q)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", help="an architecture (repeatable; default: every one with an HF folder)")
    p.add_argument("--new", type=int, default=96, help="tokens to generate (default 96)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from pretrain.generate import generate, load_for_inference
    from pretrain.models import all_archs

    torch.set_num_threads(args.threads)
    archs = args.arch or [s.name for s in all_archs() if s.hf.model_type]
    tmp = tempfile.mkdtemp(prefix="bench_hf_generate-")
    print(f"# greedy, batch 1, prompt 16 + {args.new} new tokens, {args.threads} thread(s); tiny configs")
    print(f"{'arch':9s} {'ours tok/s':>10s} {'HF tok/s':>9s} {'HF/ours speed':>14s} {'ours growth':>12s} {'HF growth':>10s}  same")
    try:
        for arch in archs:
            run, folder = folder_of(arch, tmp)
            model, spec, _, _ = load_for_inference(run, log=lambda *_: None)
            hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            prompt = torch.randint(5, model.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

            class Stamp(LogitsProcessor):
                def __init__(self):
                    self.stamps = []

                def __call__(self, input_ids, scores):
                    self.stamps.append(time.perf_counter())
                    return scores

            best = {"ours": (float("inf"), None, None), "hf": (float("inf"), None, None)}
            for _ in range(2):
                step, stamps = timed_steps(spec.step)
                t0 = time.perf_counter()
                with torch.no_grad():
                    ours = generate(model, _with_step(spec, step), prompt.tolist(), args.new, temperature=0)[0]
                t = time.perf_counter() - t0
                if t < best["ours"][0]:
                    best["ours"] = (t, growth(stamps[1:]), ours)
                stamp = Stamp()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                      logits_processor=LogitsProcessorList([stamp]), pad_token_id=0)
                t = time.perf_counter() - t0
                if t < best["hf"][0]:
                    best["hf"] = (t, growth(stamp.stamps[1:]), out[0, 16:].tolist())
            (to, go, ours), (th, gh, theirs) = best["ours"], best["hf"]
            print(f"{arch:9s} {args.new / to:10.1f} {args.new / th:9.1f} {to / th:14.2f} {go:12.2f} {gh:10.2f}  "
                  f"{'yes' if ours == theirs else 'NO'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_step(spec, step):
    """The registry entry with its step function replaced (dataclasses.replace keeps the rest)."""
    import dataclasses

    return dataclasses.replace(spec, step=step)


if __name__ == "__main__":
    main()
