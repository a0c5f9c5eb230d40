"""The planner against published training throughputs, on paper (no GPU runs here).

    PYTHONPATH=. python benchmarks/plan_calibration.py

Each row: a published run, the same model as one of our configs (the baseline with the published
shape, or the paper's own config), its hardware, GPU count, layout and micro batch as published (FSDP
as ZeRO-3), the planner's predicted tokens/s per GPU and MFU (pretrain/plan.py `predict`, parallel/plan.py's
formulas), and the published figure. Two rows set the constants (marked "fit": eta_max of the H100
from OLMo2-1B, of the A100 from TinyLlama); every other row is a prediction. MFU counts the model's
own FLOPs per token (its registry formula: attention included), as the sources roughly do.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA = "model.tie_embeddings=false"
RUNS = [  # (name, config, overrides, gpu, gpus, engine, published tokens/s/GPU or None, published MFU or None, role)
    ("OLMo2-1B, OLMo-core (FSDP, bf16)", "baseline/xl",
     ["model.d_model=2048", "model.n_layers=16", "model.n_heads=16", "model.ffn_hidden=8192", "model.vocab_size=100352",
      "model.max_seq_len=4096", "data.seq_len=4096", "train.global_batch_seqs=1024", "train.micro_batch_seqs=4", LLAMA],
     "h100", 64, "zero3", 55000, None, "fit"),
    ("OLMo-1B, OLMo-core 2024-09", "baseline/xl",
     ["model.d_model=2048", "model.n_layers=16", "model.n_heads=16", "model.ffn_hidden=8192", "model.vocab_size=50304",
      "model.max_seq_len=4096", "data.seq_len=4096", "train.global_batch_seqs=1024", "train.micro_batch_seqs=4", LLAMA],
     "h100", 64, "zero3", 45500, 0.395, "prediction"),
    ("OLMo-7B, OLMo-core 2024-09", "baseline/xl",
     ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.ffn_hidden=11008", "model.vocab_size=50304",
      "model.max_seq_len=4096", "data.seq_len=4096", "train.global_batch_seqs=1024", "train.micro_batch_seqs=2", LLAMA],
     "h100", 64, "zero3", 9850, 0.475, "prediction"),
    ("TinyLlama 1.1B (FSDP, no recompute)", "baseline/xl",
     ["model.d_model=2048", "model.n_layers=22", "model.n_heads=32", "model.n_kv_heads=4", "model.ffn_hidden=5632",
      "model.vocab_size=32000", "model.max_seq_len=2048", "data.seq_len=2048", "train.global_batch_seqs=1024",
      "train.micro_batch_seqs=8", LLAMA],
     "a100", 16, "zero3", 24000, 0.56, "fit"),
    ("Llama 3.1 8B, torchtitan (FSDP, selective recompute)", "baseline/xl",
     ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8", "model.ffn_hidden=14336",
      "model.vocab_size=128256", "model.max_seq_len=8192", "data.seq_len=8192", "train.global_batch_seqs=8",
      "train.micro_batch_seqs=1", "parallel.recompute=full", LLAMA],
     "h100", 8, "zero3", 5762, 0.36, "prediction"),
    ("Megatron-LM 175B-class, TP8 x PP8 (H100)", "baseline/xl",
     ["model.d_model=12288", "model.n_layers=96", "model.n_heads=96", "model.ffn_hidden=32768", "model.vocab_size=131072",
      "model.max_seq_len=4096", "data.seq_len=4096", "train.global_batch_seqs=1536", "train.micro_batch_seqs=1",
      "parallel.tp=8", "parallel.pp=8", LLAMA],
     "h100", 1024, "ddp", None, 0.445, "prediction (41-48%)"),
    ("RT 300M-12L, one H100 (spec-003 §4)", "rt/300m-12l", [], "h100", 1, "ddp", 42000, None, "prediction"),
    ("RT 300M-6L, one H100 (spec-003 §4)", "rt/300m-6l", [], "h100", 1, "ddp", 49000, None, "prediction"),
    ("Transformer 300M-12L, same paper", "rt/t-300m-12l", ["train.micro_batch_seqs=32"], "h100", 1, "ddp", 132000, None,
     "prediction"),
    ("Transformer 300M-6L, same paper", "rt/t-300m-6l", ["train.micro_batch_seqs=32"], "h100", 1, "ddp", 153000, None,
     "prediction"),
]


def main() -> None:
    from parallel.plan import HARDWARE, RT_LAYER_FORWARD_MS, RT_TABLE_SHAPE, SERIAL_KAPPA, SERIAL_STEP_S, efficiency
    from pretrain.config import load_config
    from pretrain.plan import predict

    # the position-serial constants, fitted to RT's per-layer forward latency (parallel/plan.py), and the fit's rows
    d, f, T = RT_TABLE_SHAPE["d"], RT_TABLE_SHAPE["f"], RT_TABLE_SHAPE["T"]
    hw = HARDWARE["h100"]
    rate = hw.peak_tflops * 1e12 * efficiency(hw, d)
    print(f"serial loop constants: {SERIAL_STEP_S * 1e6:.1f} us per step, kappa {SERIAL_KAPPA:.3f} "
          f"(RT layer forward, d={d}, T={T}, one H100)")
    for b, ms in RT_LAYER_FORWARD_MS.items():
        model = T * SERIAL_STEP_S + b * T * ((6 * d * d + 4 * d * f + 2 * d * T) / SERIAL_KAPPA + 6 * d * d) / rate
        print(f"  batch {b:>5}: published {ms:7.2f} ms, fit {model * 1e3:7.2f} ms")
    print()

    print(f"{'published run':54s} {'GPUs':>6s} {'predicted tok/s/GPU':>20s} {'published':>10s} {'ratio':>6s} "
          f"{'MFU pred.':>9s} {'published':>9s}  role")
    for name, config, over, gpu, gpus, engine, tokens, mfu, role in RUNS:
        cfg = load_config(config, over + ["train.compile=false"], check_data=False)
        c = predict(cfg, gpus, gpu, engine)
        ratio = f"{c.tokens_per_s_per_gpu / tokens:.2f}" if tokens else "-"
        print(f"{name:54s} {gpus:>4d}{gpu[0].upper()} {c.tokens_per_s_per_gpu:>20,.0f} "
              f"{f'{tokens:,}' if tokens else '-':>10s} {ratio:>6s} {c.mfu:>9.1%} {f'{mfu:.1%}' if mfu else '-':>9s}  {role}")


if __name__ == "__main__":
    main()
