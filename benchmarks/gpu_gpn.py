"""GPN (spec-002) on a CUDA device: the checks the CPU suite cannot make there, and a few timings.

    PYTHONPATH=. python benchmarks/gpu_gpn.py [--steps 3]

Checks (max differences, PASS / FAIL against the tolerance):
- fp32 logits on CUDA against the same model on CPU (a small GPN+M, T=64);
- streaming decode against the window on CUDA;
- segment recomputation against plain BPTT on CUDA (loss and gradients, fp32);
- a bf16-autocast training step's loss against fp32, the state and memory kept in fp32 (spec A14).
Timings (CUDA events, medians of --steps after three warm-ups), the 130M 1-layer GPN+M (d=2496, memory 15 x
128 x 256) at T=256, batch 8, bf16 autocast: a training step (forward + backward) with segment
recomputation, eager and with the step compiled (GPN.compile); decode tokens/s at batch 1.
Imports only the model modules (no config system), so it runs with the device image's torch.
"""
from __future__ import annotations

import argparse

import torch

from gpu_sps_rt import check, results, timed  # benchmarks/: the same checks and CUDA-event timing
from pretrain.data.batch import Batch
from pretrain.models.gpn import GPN, GPNConfig

DEV = "cuda"


def batch_of(B: int, T: int, V: int, device) -> Batch:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, V, (B, T + 1), generator=g)
    return Batch(t[:, :-1], t[:, 1:], torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.int32),
                 torch.arange(T).expand(B, T)).to(device)


def small() -> GPN:
    torch.manual_seed(0)
    m = GPN(GPNConfig(vocab_size=512, d_emb=64, d_state=128, d_ffn=256, mem_heads=4, d_key=16, d_value=32,
                      n_layers=2, segment=8))
    with torch.no_grad():  # break the zero inits so that every path matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def checks() -> None:
    cpu = small()
    gpu = small().to(DEV)
    b = batch_of(4, 64, 512, "cpu")
    with torch.no_grad():
        ref = cpu.logits(b.tokens)
        got = gpu.logits(b.tokens.to(DEV))
        check("fp32 logits CUDA vs CPU", (got.cpu() - ref).abs().max().item(), 1e-3)
        state, pieces = gpu.new_state(4), []
        for t in range(64):
            pieces.append(gpu.step(b.tokens[:, t:t + 1].to(DEV), state)[0])
        check("streaming decode vs the window (CUDA)", (torch.cat(pieces, 1) - got).abs().max().item(), 1e-4)
    bg = b.to(DEV)
    grads = []
    for recompute in (False, True):
        gpu.zero_grad()
        gpu.segment_recompute = recompute
        loss, _ = gpu(bg)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in gpu.parameters()]))
    check("segment recomputation vs plain BPTT: loss", abs(grads[0][0] - grads[1][0]), 1e-5)
    check("segment recomputation vs plain BPTT: gradients",
          max((a - c).abs().max().item() for a, c in zip(grads[0][1], grads[1][1])), 1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss16, _ = gpu(bg)
        sp, state = gpu.states(bg.tokens)
    ok_dtype = sp.dtype == torch.float32 and state[1].dtype == torch.float32
    check("bf16 autocast: relative loss vs fp32 (state and memory fp32: "
          f"{'yes' if ok_dtype else 'NO'})", abs(loss16.item() - grads[0][0]) / grads[0][0] + (0 if ok_dtype else 1), 2e-2)


def timings(steps: int) -> None:
    torch.manual_seed(0)
    B, T = 8, 256
    batch = batch_of(B, T, 32000, DEV)
    for compiled in (False, True):
        m = GPN(GPNConfig(loss_chunk=2048)).to(DEV)
        m.segment_recompute = True
        if compiled:
            m.compile()

        def train_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = m(batch)
            loss.backward()
            m.zero_grad(set_to_none=True)

        s = timed(train_step, steps) / 1e3  # ms -> s
        print(f"130M GPN+M training step, B={B} T={T}, bf16 autocast, segments of {m.cfg.segment_for(T)}, "
              f"{'compiled step' if compiled else 'eager'}: {s * 1e3:,.0f} ms, {B * T / s:,.0f} tok/s", flush=True)
    m = GPN(GPNConfig()).to(DEV).eval()
    state = m.new_state(1)
    tok = batch.tokens[:1, :1]
    with torch.no_grad():
        m.step(batch.tokens[:1, :64], state)
        s = timed(lambda: m.step(tok, state), 32) / 1e3
    print(f"130M GPN+M decode, batch 1, fp32: {1 / s:,.1f} tok/s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    checks()
    timings(a.steps)
    print(f"{sum(results)}/{len(results)} checks passed")


if __name__ == "__main__":
    main()
