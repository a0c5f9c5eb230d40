"""Attention paths side by side, per mask (issue 28).

    PYTHONPATH=. python benchmarks/bench_attention.py            # CUDA: every path and mask, N = 4,096 and 8,192
    PYTHONPATH=. python benchmarks/bench_attention.py --cpu      # RT (--rt): one RT layer (d 1024, 16 heads, ALiBi, fp32) over N = 512 positions, batch 8: the tile schedule
with the PyTorch tile (tiled.py) against the same schedule with the Triton tile kernels (triton_tile.py),
leaf 1 and leaf 16 (fewer launches), forward and forward + backward, and the largest difference of z.

CPU: an SPS model's evaluation, FlexAttention vs SDPA
    PYTHONPATH=. python benchmarks/bench_attention.py --rt       # CUDA: the RT tile as Triton kernels vs PyTorch

CUDA: for each mask (causal; causal + packed documents; the same with a 256-token window; the four SPS
masks over N slots, i.e. N / 2 tokens, w = 64) and each capable path (sdpa with the dense mask or its
causal kernel, flex, triton), the forward and the forward + backward in bf16, B = 2, H = 16 (GQA over 4
key/value heads), head dim 64. TFLOP/s count useful work only: 4 * D multiply-adds per visible
(query, key) pair forward, 2.5x that for the backward. `vs flash` divides unmasked flash attention's
TFLOP/s (SDPA over every pair, no mask) by the path's: the aim is at most 1.2. Each mask's line also says
which share of 64 x 64 tiles (the Triton kernel's) and 128 x 128 tiles (FlexAttention's) are empty, partial
and full, which is what the masked paths' speed follows.

RT (--rt): one RT layer (d 1024, 16 heads, ALiBi, fp32) over N = 512 positions, batch 8: the tile schedule
with the PyTorch tile (tiled.py) against the same schedule with the Triton tile kernels (triton_tile.py),
leaf 1 and leaf 16 (fewer launches), forward and forward + backward, and the largest difference of z.

CPU: an SPS model (d 256, 2 layers, 4 heads of 64) evaluated (no_grad logits) at T = 2,048 and 4,096 tokens
through the automatic path (FlexAttention at these lengths) and with SDPA forced, best of 3 after a warm-up.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.attention as attn  # noqa: E402
from kernels.attention import masks, runs  # noqa: E402


def sps_mask(variant: str, N: int, B: int, docs: int, device, w: int = 64):
    from pretrain.models.sps import VARIANTS, SlotMask, slot_tables

    T = N // 2
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(T - 1, generator=g)[:docs - 1] + 1).values
    d = torch.zeros(T, dtype=torch.long)
    d[cuts] = 1
    d = d.cumsum(0)[None].repeat(B, 2).to(device)
    tok, kind = slot_tables(T, device)
    return SlotMask(tok, kind, tok, kind, VARIANTS[variant][0], None if variant == "2x_memory" else w, d, d,
                    name=variant, tokens=T)


def decoder_masks(N: int, B: int, docs: int, device):
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(N - 1, generator=g)[:docs - 1] + 1).values
    d = torch.zeros(N, dtype=torch.long)
    d[cuts] = 1
    d = d.cumsum(0)[None].repeat(B, 1).to(device)
    return {"causal": masks.causal(), "causal+doc": masks.causal() & masks.document(d),
            "causal+doc+window256": masks.causal() & masks.document(d) & masks.window(256)}


def visible_pairs(mask, B: int, N: int, device) -> float:
    r = runs.column_runs(mask, B, N, N, 0, device)
    return float((r[..., 1] - r[..., 0]).clamp_min(0).sum()) * (B / r.shape[0])


def tile_shares(mask, B: int, N: int, block: int, device) -> str:
    c = runs.tile_classes(runs.column_runs(mask, B, N, N, 0, device), N, N, block, block)
    n = c.numel()
    return "/".join(f"{float((c == k).sum()) / n:.0%}" for k in (runs.EMPTY, runs.PARTIAL, runs.FULL))


def cuda_time(fn, reps: int = 10) -> float:
    """Median seconds of fn() over reps, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def run_path(path, q, k, v, mask, backward: bool):
    attn.use_path(path)
    try:
        if not backward:
            with torch.no_grad():
                return cuda_time(lambda: attn.attention(q, k, v, mask))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        g = torch.randn_like(q)

        def step():
            torch.autograd.grad(attn.attention(*leaves, mask), leaves, g)
        return cuda_time(step)
    finally:
        attn.use_path(None)


def gpu(args) -> None:
    dev = torch.device("cuda")
    B, H, H_kv, D = 2, 16, 4, 64
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, B {B}, H {H} (kv {H_kv}), D {D}")
    print(f"{'N':>6} {'mask':>22} {'tiles64 e/p/f':>14} {'tiles128 e/p/f':>15} {'path':>7} {'fwd ms':>8} "
          f"{'fwd TF/s':>8} {'vs flash':>8} {'f+b ms':>8} {'f+b TF/s':>8} {'vs flash':>8}")
    for N in args.N:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, H_kv, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        flops = lambda pairs: 4 * D * pairs * H  # noqa: E731  (pairs already summed over the batch)
        # unmasked flash attention: SDPA over every pair
        kk, vv = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
        sd = torch.nn.functional.scaled_dot_product_attention
        with torch.no_grad():
            t_f = cuda_time(lambda: sd(q, kk, vv))
        leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
        t_fb = cuda_time(lambda: torch.autograd.grad(sd(*leaves), leaves, q))
        full_pairs = B * N * N
        base_f, base_fb = flops(full_pairs) / t_f / 1e12, 3.5 * flops(full_pairs) / t_fb / 1e12
        print(f"{N:>6} {'unmasked (flash)':>22} {'':>14} {'':>15} {'sdpa':>7} {t_f * 1e3:>8.2f} {base_f:>8.0f} "
              f"{1.0:>8.2f} {t_fb * 1e3:>8.2f} {base_fb:>8.0f} {1.0:>8.2f}")
        all_masks = dict(decoder_masks(N, B, 8, dev))
        for variant in ("sps", "delayed_state", "reverse_sps", "2x_memory"):
            all_masks[f"sps:{variant}"] = sps_mask(variant, N, B, 8, dev)
        for name, mask in all_masks.items():
            pairs = visible_pairs(mask, B, N, dev)
            shares = (tile_shares(mask, B, N, 64, dev), tile_shares(mask, B, N, 128, dev))
            for path in ("sdpa", "flex", "triton"):
                try:
                    tf = run_path(path, q, k, v, mask, False)
                    tfb = run_path(path, q, k, v, mask, True)
                except Exception as e:  # a path that cannot serve this mask: say so and go on
                    print(f"{N:>6} {name:>22} {path:>7}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
                    continue
                f, fb = flops(pairs) / tf / 1e12, 3.5 * flops(pairs) / tfb / 1e12
                print(f"{N:>6} {name:>22} {shares[0]:>14} {shares[1]:>15} {path:>7} {tf * 1e3:>8.2f} {f:>8.0f} "
                      f"{base_f / f:>8.2f} {tfb * 1e3:>8.2f} {fb:>8.0f} {base_fb / fb:>8.2f}", flush=True)
                shares = ("", "")


def cpu(args) -> None:
    from pretrain.models.sps import SPS, SPSConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = SPS(SPSConfig(vocab_size=8192, d_model=256, n_layers=2, n_heads=4, ffn_hidden=688,
                          max_seq_len=max(args.T), sps_window=64, predict_id=4, eos_id=2)).eval()
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}: SPS d 256, 2 layers, 4 heads of 64, "
          f"w 64, fp32; no_grad logits, best of 3")
    print(f"{'T':>6} {'slots':>6} {'sdpa s':>8} {'auto s':>8} {'auto path':>10} {'speed-up':>8} {'max |diff|':>10}")
    for T in args.T:
        tokens = torch.randint(5, 8192, (1, T), generator=torch.Generator().manual_seed(T))
        tokens[0, torch.randperm(T, generator=torch.Generator().manual_seed(1))[:3]] = 2  # 4 documents

        def timed(path):
            attn.use_path(path)
            try:
                with torch.no_grad():
                    out = model.logits(tokens)  # warm-up (compiles FlexAttention for this shape)
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        model.logits(tokens)
                        best = min(best, time.perf_counter() - t0)
                return best, out
            finally:
                attn.use_path(None)
        t_sdpa, want = timed("sdpa")
        attn.reset_paths_used()
        t_auto, got = timed(None)
        used = "+".join(sorted(attn.paths_used()))
        print(f"{T:>6} {2 * T:>6} {t_sdpa:>8.3f} {t_auto:>8.3f} {used:>10} {t_sdpa / t_auto:>7.2f}x "
              f"{(got - want).abs().max().item():>10.1e}", flush=True)


def rt(args) -> None:
    from kernels.rt_prefill import tiled, triton_tile
    from pretrain.models.rt import RT, LayerView, RTConfig

    torch.manual_seed(0)
    model = RT(RTConfig(vocab_size=128, d_model=1024, n_layers=1, n_heads=16, max_seq_len=512)).cuda()
    view = LayerView(model.blocks[0], None, 0)
    x = torch.randn(8, 512, 1024, device="cuda")
    print(f"{torch.cuda.get_device_name()} | RT layer d 1024, 16 heads, N 512, batch 8, fp32")
    print(f"{'tile':>8} {'leaf':>4} {'fwd ms':>8} {'f+b ms':>8} {'max |z diff|':>12}")
    with torch.no_grad():
        want = tiled.forward(x, view, 1)[0]
    for name, ops in (("pytorch", tiled.TORCH_OPS), ("triton", triton_tile.OPS)):
        for leaf in (1, 16):
            with torch.no_grad():
                z = tiled.forward(x, view, leaf, ops=ops)[0]
                t_f = cuda_time(lambda: tiled.forward(x, view, leaf, ops=ops), reps=3)
            xg = x.detach().requires_grad_()
            t_fb = cuda_time(lambda: tiled.prefill(xg, view, leaf, ops=ops).sum().backward(), reps=3)
            print(f"{name:>8} {leaf:>4} {t_f * 1e3:>8.1f} {t_fb * 1e3:>8.1f} {(z - want).abs().max().item():>12.2e}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU evaluation benchmark instead of the CUDA one")
    ap.add_argument("--rt", action="store_true", help="CUDA: the RT tile kernels against the PyTorch tile")
    ap.add_argument("--N", type=int, nargs="+", default=[4096, 8192], help="CUDA: sequence lengths (slots)")
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 4096], help="CPU: tokens per sample")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    args = ap.parse_args()
    if args.cpu:
        cpu(args)
    elif not torch.cuda.is_available():
        sys.exit("bench_attention: no CUDA device here; run with --cpu for the CPU benchmark")
    else:
        rt(args) if args.rt else gpu(args)


if __name__ == "__main__":
    main()
