"""CRT's costs on this machine (issue 14's performance points), each measured side by side in one run.

    PYTHONPATH=. python benchmarks/bench_crt.py train    # step time vs a roformer of the same D at K=1,2,5
    PYTHONPATH=. python benchmarks/bench_crt.py memory   # peak activation memory and step time per recompute policy
    PYTHONPATH=. python benchmarks/bench_crt.py decode   # decode tokens/s: CRT D=1 C=2048 vs roformers
    PYTHONPATH=. python benchmarks/bench_crt.py all

train: forward and backward timed separately (the optimizer step is the same for both and left out),
the models alternating round by round, medians reported. memory: each policy runs in a fresh
process (so peak RSS is its own); the activation peak is the step's peak RSS minus the RSS before it,
once the weights, gradients and optimizer state exist; processes alternate over rounds. decode:
batch 1, a 16-token prompt streamed, then --tokens tokens generated greedily, fp32, the models
alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from procmem import status_kib  # benchmarks/ (this script's folder)
from pretrain.data.batch import Batch
from pretrain.models.base import StepContext
from pretrain.models.crt import CRT, CRTConfig
from pretrain.models.registry import count_parameters

HERE = os.path.dirname(os.path.abspath(__file__))


def config(C, D, K, vocab, T, corrected=True, n_heads=0, **kw) -> CRTConfig:
    extra = dict(correction="add", k_max=K, k_min=0) if corrected else dict(correction="none", k_max=1, k_min=0)
    return CRTConfig(vocab_size=vocab, d_model=C, n_layers=D, n_heads=n_heads or max(1, C // 64), max_seq_len=T,
                     **extra, **kw)


def batch_of(B, T, vocab, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=g)
    return Batch(tokens[:, :-1], tokens[:, 1:], torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.int32),
                 torch.arange(T).expand(B, T))


def fwd_bwd_times(model, batch) -> tuple[float, float]:
    ctx = StepContext(step=0, seed=0, training=True)
    t0 = time.perf_counter()
    loss, _ = model(batch, ctx)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def bench_train(a) -> None:
    torch.manual_seed(0)
    T, B, V = a.seq, a.batch, a.vocab
    models = {"roformer": CRT(config(a.d_model, a.layers, 1, V, T, corrected=False)).train()}
    for K in (1, 2, 5):
        models[f"crt K={K}"] = CRT(config(a.d_model, a.layers, K, V, T)).train()
    batch = batch_of(B, T, V)
    for m in models.values():  # warm up allocator and kernels
        fwd_bwd_times(m, batch)
    times = {name: [] for name in models}
    for _ in range(a.rounds):
        for name, m in models.items():
            times[name].append(fwd_bwd_times(m, batch))
    med = {n: (statistics.median(f for f, _ in t), statistics.median(b for _, b in t)) for n, t in times.items()}
    rf, rb = med["roformer"]
    print(f"# training step, C={a.d_model} D={a.layers} T={T} batch {B} vocab {V}, {torch.get_num_threads()} threads, "
          f"median of {a.rounds} alternating rounds")
    print(f"{'model':<12} {'forward s':>10} {'backward s':>11} {'fwd x':>7} {'bwd x':>7} {'step x':>7}")
    for name, (f, b) in med.items():
        print(f"{name:<12} {f:>10.3f} {b:>11.3f} {f / rf:>7.2f} {b / rb:>7.2f} {(f + b) / (rf + rb):>7.2f}")


def memory_child(a) -> None:
    """One policy in this process: weights, grads and Adam moments first (a small step), then the
    measured steps; prints JSON with the activation peak and the median step time."""
    from pretrain.models import get_arch

    torch.manual_seed(0)
    model = CRT(config(a.d_model, a.layers, a.k, a.vocab, a.seq, dropout=0.0)).train()
    if a.policy != "none":
        get_arch("crt").recompute_policies()[a.policy].apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    small = batch_of(1, 8, a.vocab)
    ctx = StepContext(step=0, seed=0, training=True)
    model(small, ctx)[0].backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradient buffers: they are not activations
    batch = batch_of(a.batch, a.seq, a.vocab)
    before = status_kib("VmRSS") * 1024
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        model(batch, ctx)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    peak = status_kib("VmHWM") * 1024  # not ru_maxrss: the parent's peak
    print(json.dumps({"policy": a.policy, "activation_peak_mb": (peak - before) / 2**20,
                      "step_s": statistics.median(times)}))


def bench_memory(a) -> None:
    policies = ["none", "pass", "block"]
    results = {p: [] for p in policies}
    env = dict(os.environ, MALLOC_ARENA_MAX="1")  # glibc malloc without arenas: RSS follows use closely
    env.pop("LD_PRELOAD", None)
    for _ in range(a.rounds):
        for p in policies:
            cmd = [sys.executable, __file__, "_memory_child", "--policy", p, "--k", str(a.k), "--d-model",
                   str(a.d_model), "--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch),
                   "--vocab", str(a.vocab), "--steps", str(a.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            results[p].append(json.loads(out.strip().splitlines()[-1]))
    med = {p: (statistics.median(r["activation_peak_mb"] for r in rs), statistics.median(r["step_s"] for r in rs))
           for p, rs in results.items()}
    m0, t0 = med["none"]
    print(f"# activation checkpointing at K={a.k}, C={a.d_model} D={a.layers} T={a.seq} batch {a.batch}: peak "
          f"activation memory (peak RSS of the step minus RSS before it) and step time, median of {a.rounds} "
          f"alternating processes x {a.steps} steps")
    print(f"{'policy':<8} {'activation MB':>14} {'memory x':>9} {'step s':>8} {'time x':>7}")
    for p, (m, t) in med.items():
        print(f"{p:<8} {m:>14.0f} {m / m0:>9.2f} {t:>8.3f} {t / t0:>7.2f}")
    print("(full = pass, the registry's recommended policy)")


def decode_tokens_per_s(model, prompt, n) -> float:
    with torch.no_grad():
        state = model.new_state(1)
        logits, state = model.step(prompt, state)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(n):
            logits, state = model.step(tok, state)
            tok = logits[:, -1].argmax(-1, keepdim=True)
        return n / (time.perf_counter() - t0)


def bench_decode(a) -> None:
    V, L = 32000, 16 + a.tokens
    models = {"CRT D=1 C=2048": config(2048, 1, 5, V, L, n_heads=16),
              "roformer N=6 C=1088": config(1088, 6, 1, V, L, corrected=False, n_heads=16),
              "roformer N=10 C=1088 (params ~ CRT)": config(1088, 10, 1, V, L, corrected=False, n_heads=16)}
    built = {}
    for name, cfg in models.items():
        torch.manual_seed(0)
        built[name] = CRT(cfg).eval()
    prompt = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(0))
    rates = {n: [] for n in built}
    for m in built.values():
        decode_tokens_per_s(m, prompt, 8)  # warm-up
    for _ in range(a.rounds):
        for n, m in built.items():
            rates[n].append(decode_tokens_per_s(m, prompt, a.tokens))
    crt = statistics.median(rates["CRT D=1 C=2048"])
    print(f"# decode at batch 1, fp32, {torch.get_num_threads()} threads: 16-token prompt, then {a.tokens} tokens "
          f"greedily (context up to {L}); median of {a.rounds} alternating rounds")
    print(f"{'model':<36} {'params':>8} {'tok/s':>8} {'ms/tok':>8} {'CRT speedup':>12}")
    for n, m in built.items():
        r = statistics.median(rates[n])
        p = count_parameters(m)["total"] / 1e6
        print(f"{n:<36} {p:>7.1f}M {r:>8.1f} {1000 / r:>8.2f} {crt / r:>11.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["train", "memory", "decode", "all", "_memory_child"])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=2, help="D (and the roformer's N)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=5, help="passes for the memory benchmark")
    p.add_argument("--steps", type=int, default=2, help="measured steps per memory process")
    p.add_argument("--policy", default="none")
    p.add_argument("--tokens", type=int, default=128, help="decode: tokens generated per round")
    a = p.parse_args()
    if a.what == "_memory_child":
        return memory_child(a)
    if a.what in ("train", "all"):
        bench_train(a)
    if a.what in ("memory", "all"):
        bench_memory(a)
    if a.what in ("decode", "all"):
        bench_decode(a)


if __name__ == "__main__":
    main()
