"""One training step (forward + backward, bf16 autocast) of the baseline Transformer++ on CUDA, eager,
with and without document masks: what the masks-as-values change costs on a GPU. Imports only
pretrain.models.baseline, so the same script times an earlier revision (PYTHONPATH=<its tree>):

    PYTHONPATH=. python benchmarks/bench_gpu_step.py --d 1024 --layers 8 --seq 2048 --batch 8
"""
import argparse
import time
from types import SimpleNamespace

import torch

from pretrain.models.baseline import BaselineConfig, TransformerPP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    for document_mask in (False, True):
        cfg = BaselineConfig(vocab_size=32768, d_model=a.d, n_layers=a.layers, n_heads=a.heads, max_seq_len=a.seq,
                             document_mask=document_mask)
        model = TransformerPP(cfg).cuda()
        B, T = a.batch, a.seq
        tokens = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
        doc_ids = torch.cumsum(torch.rand(B, T, device="cuda") < 1 / 300, dim=1)
        batch = SimpleNamespace(tokens=tokens, positions=torch.arange(T, device="cuda").expand(B, T),
                                labels=tokens.roll(-1, 1), loss_mask=torch.ones(B, T, dtype=torch.bool, device="cuda"),
                                doc_ids=doc_ids)
        times = []
        for i in range(a.steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16):
                loss, _ = model(batch)
            loss.backward()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        times.sort()
        med = times[len(times) // 2]
        print(f"document_mask={document_mask}: step {med * 1e3:.1f} ms (median of {a.steps}), "
              f"{B * T / med / 1e3:.0f}k tokens/s, loss {loss.item():.4f}")
        del model


if __name__ == "__main__":
    main()
