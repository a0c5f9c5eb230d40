"""SPS and RT on a CUDA device: the checks the CPU suite cannot make there, and a few timings.

    PYTHONPATH=. python benchmarks/gpu_sps_rt.py

Checks (printed as max differences, with PASS / FAIL against the tolerance):
- SPS: fp32 logits on CUDA against the same model on CPU; cached decode against the full forward on
  CUDA; a bf16-autocast training step's loss against fp32.
- RT: the tiled forward and custom backward against the naive loop on CUDA (fp32), and decode against
  prefill.
Timings (CUDA events, medians of --steps after warm-up):
- SPS against Standard: one bf16-autocast training step (forward, backward) at d=1024, 8 layers,
  T=1024 input tokens, batch 8, documents masked (SDPA with the boolean mask on both).
- RT: one layer's tiled forward and forward + backward against the naive loop at N=512, d=1024,
  batch 8, fp32 (the paper's gain is memory traffic; eager PyTorch on a GPU is launch-bound here).
Imports only the model and kernel modules (no config system), so it runs with the device image's torch.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kernels.rt_prefill import reference, tiled
from pretrain.data.batch import Batch
from pretrain.models.baseline import BaselineConfig, TransformerPP
from pretrain.models.rt import RT, LayerView, RTConfig
from pretrain.models.sps import SPS, SPSConfig

DEV = "cuda"
results = []


def check(name: str, diff: float, tol: float) -> None:
    ok = diff <= tol
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: max diff {diff:.2e} (tolerance {tol:.0e})")


def timed(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def batch_of(B: int, T: int, V: int, eos: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, V, (B, T + 1), generator=g)
    tokens[:, T // 3] = eos
    eos_mask = (tokens == eos).long()
    doc = eos_mask.cumsum(1) - eos_mask
    return Batch(tokens[:, :-1], tokens[:, 1:], torch.ones(B, T, dtype=torch.bool), doc[:, :-1],
                 torch.arange(T).expand(B, T).clone()).to(DEV)


def sps_checks() -> None:
    cfg = SPSConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, sps_window=3, eos_id=2)
    torch.manual_seed(0)
    cpu = SPS(cfg).eval()
    gpu = SPS(cfg).to(DEV).eval()
    gpu.load_state_dict(cpu.state_dict())
    tokens = torch.randint(5, 128, (2, 40))
    tokens[:, 17] = 2
    with torch.no_grad():
        full = gpu.logits(tokens.to(DEV))
        check("SPS logits CUDA vs CPU (fp32)", (full.cpu() - cpu.logits(tokens)).abs().max().item(), 1e-3)
        state = gpu.new_state(2)
        pieces = [gpu.step(tokens[:, :9].to(DEV), state)[0]]
        pieces += [gpu.step(tokens[:, t:t + 1].to(DEV), state)[0] for t in range(9, 40)]
        check("SPS cached decode vs full forward on CUDA", (torch.cat(pieces, 1) - full).abs().max().item(), 1e-3)
    gpu.train()
    b = batch_of(2, 40, 128, 2)
    with torch.no_grad():
        l32 = gpu(b)[0].item()
        with torch.autocast("cuda", torch.bfloat16):
            l16 = gpu(b)[0].item()
    check("SPS loss bf16 autocast vs fp32", abs(l16 - l32), 5e-2)


def rt_checks() -> None:
    torch.manual_seed(0)
    model = RT(RTConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=128)).to(DEV)
    view = LayerView(model.blocks[0], None, 0)
    x = torch.randn(3, 37, 64, device=DEV, requires_grad=True)
    g = torch.randn(3, 37, 64, device=DEV)
    params = list(model.blocks[0].parameters())
    z0 = reference.prefill(x, view)
    want = torch.autograd.grad(z0, [x, *params], g)
    z1 = tiled.prefill(x, view)
    got = torch.autograd.grad(z1, [x, *params], g)
    check("RT tiled vs naive forward on CUDA (fp32)", (z1 - z0).abs().max().item(), 1e-4)
    rel = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(got, want))
    check("RT custom backward vs autograd through the naive loop on CUDA (fp32, relative)", rel, 1e-4)
    model.eval()
    tokens = torch.randint(0, 128, (2, 30), device=DEV)
    with torch.no_grad():
        full = model.logits(tokens)
        state = model.new_state(2)
        pieces = [model.step(tokens[:, :7], state)[0]] + [model.step(tokens[:, t:t + 1], state)[0] for t in range(7, 30)]
        check("RT decode vs prefill on CUDA", (torch.cat(pieces, 1) - full).abs().max().item(), 1e-3)


def sps_timing(a) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=32768, d_model=1024, n_layers=8, n_heads=16, max_seq_len=a.seq, document_mask=True)
    out = {}
    for name, model in (("standard", TransformerPP(BaselineConfig(**common))), ("sps", SPS(SPSConfig(**common)))):
        model = model.to(DEV)
        b = batch_of(a.batch, a.seq, 32768, 2)

        def step(model=model):  # bound now: the loop deletes its name after timing
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(b)[0]
            loss.backward()
            model.zero_grad(set_to_none=True)

        out[name] = timed(step, a.steps)
        mem = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        print(f"{name:>9}: {out[name]:8.1f} ms per step, peak {mem:.1f} GiB")
        del model
        torch.cuda.empty_cache()
    print(f"RATIO SPS/Standard training step (bf16, d=1024, L=8, T={a.seq}, B={a.batch}, documents) = "
          f"{out['sps'] / out['standard']:.2f}x")


def rt_timing(a) -> None:
    torch.manual_seed(0)
    model = RT(RTConfig(vocab_size=128, d_model=1024, n_layers=1, n_heads=16, max_seq_len=512)).to(DEV)
    view = LayerView(model.blocks[0], None, 0)
    x = torch.randn(8, 512, 1024, device=DEV, requires_grad=True)
    out = {}
    for name, fn in (("tiled", lambda: tiled.prefill(x, view)), ("naive", lambda: reference.prefill(x, view))):
        with torch.no_grad():
            out[name + " fwd"] = timed(fn, 3)
        out[name + " fwd+bwd"] = timed(lambda: fn().sum().backward(), 3)
    for k, v in out.items():
        print(f"RT layer N=512 d=1024 B=8 fp32 {k:>14}: {v:9.1f} ms")
    print(f"RATIO naive/tiled RT layer forward = {out['naive fwd'] / out['tiled fwd']:.2f}x, forward+backward = "
          f"{out['naive fwd+bwd'] / out['tiled fwd+bwd']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    print(torch.__version__, torch.cuda.get_device_name())
    sps_checks()
    rt_checks()
    sps_timing(a)
    rt_timing(a)
    print(f"{sum(results)}/{len(results)} checks passed")


if __name__ == "__main__":
    main()
