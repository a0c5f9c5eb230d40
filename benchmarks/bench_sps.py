"""SPS (spec-001) against Standard on this machine: training step time, decode throughput, peak
activation memory with and without recompute, and the block sparsity of the masks, side by side.

    PYTHONPATH=. python benchmarks/bench_sps.py                 # all four sections (~2.5 min on 2 idle cores)
    PYTHONPATH=. python benchmarks/bench_sps.py --variants      # also time delayed_state and 2x_memory (+1 min)
    PYTHONPATH=. python benchmarks/bench_sps.py train --profile # where SPS's step time goes, op by op
    PYTHONPATH=. python benchmarks/bench_sps.py --quick         # fewer rounds, smaller batches: a smoke run

Models: the registry's Standard (Transformer++, pretrain.models.baseline) and SPS (pretrain.models.sps)
at d=512, 8 layers, 8 heads, FFN 1536, vocab 32,000, T=256 input tokens per sequence (SPS runs 2T = 512
slots), sps_window w=64, document masks on (both models' configs set model.document_mask: true; the
samples hold one document each). fp32, eager unless --compile, --threads torch threads (default 2).

train: one step = forward + backward + fused AdamW step + zero_grad, on the same fixed batch. Each
model gets one warm-up step, then the models alternate for --rounds rounds, in reversed order every
other round (machines here are noisy, +-10%, and the load drifts): the median step time, and the median
over rounds of each model's step time over Standard's in the same round (the headline ratio; the ratio
of the fastest steps is printed too). Both see the same T input tokens per sequence, so the ratio of
step times is the ratio per input token. With document masks both models attend through SDPA with an
explicit boolean mask (kernels/attention/sdpa.py), which computes every (query, key) pair. --profile
adds a torch.profiler table of one SPS step against one Standard step (self CPU time per op), to say
where the extra time goes.

decode: --decode-batch sequences, a --prompt-tokens random prompt prefilled with one step(), then
--decode-tokens one-token steps, greedy argmax (SPS's <predict> never chosen, as pretrain.generate
does). tokens/s = batch * decode tokens / time of the one-token steps; the prefill is timed apart.
The models alternate for --rounds rounds, medians reported. The paper reports SPS at 0.90-0.95x
Standard's throughput (with its fused GPU decode kernels).

memory: each configuration (Standard; SPS with parallel.recompute none; SPS with the registry's
recompute policy "full", which checkpoints every block) runs in a fresh process under glibc malloc
(MALLOC_ARENA_MAX=1, no preloaded caching allocator, so RSS follows use). Weights, gradients and
AdamW moments are created first by a one-token step; the activation peak is then the peak RSS of
one full step (VmHWM, from /proc: ru_maxrss would carry the parent's peak into the child) minus the
RSS before it. --mem-rounds processes per configuration, alternating; medians.

tiles: the fraction of (query block, key block) tiles holding no visible pair (Mask.empty_tiles) at
2T = --tile-slots slots (default 4096, T=2048), block --block, w=64, one document, for each variant,
in the model's de-interleaved layout [x_1..x_T | rho_1..rho_T] and in the interleaved one (x_1, rho_1,
...). A block-sparse kernel computes only the non-empty tiles; "of causal" compares that count with
the lower triangle (diagonal included) of the 2T x 2T grid, which is what a dense causal kernel
computes in the interleaved layout (where no tile below the diagonal is empty), and "x Std" with
Standard's causal triangle over T x T tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from procmem import status_kib  # noqa: E402  (benchmarks/)
from pretrain.data.batch import Batch  # noqa: E402
from pretrain.models import get_arch  # noqa: E402
from pretrain.models.base import StepContext  # noqa: E402
from pretrain.models.registry import count_parameters  # noqa: E402

VARIANTS = ("sps", "delayed_state", "reverse_sps", "2x_memory")


# -- models and batches -------------------------------------------------------------------------------
def model_cfg(a, arch: str, variant: str = "sps", max_len: int | None = None):
    """The Standard (arch baseline) or SPS config of the benchmark's size."""
    spec = get_arch(arch)
    kw = dict(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, ffn_hidden=3 * a.d_model,
              max_seq_len=max_len or a.seq, document_mask=True)
    if arch == "sps":
        kw.update(variant=variant, sps_window=a.window)
    return spec.config_cls(**kw)


def build(a, name: str, max_len: int | None = None):
    """name: "standard" or an SPS variant; the model in training mode, seeded the same way."""
    torch.manual_seed(0)
    arch, variant = ("baseline", "sps") if name == "standard" else ("sps", name)
    model = get_arch(arch).build(model_cfg(a, arch, variant, max_len))
    if a.compile:
        model.compile()
    return model.train()


def batch_of(B: int, T: int, vocab: int, seed: int = 0) -> Batch:
    """Random ids above the special ones (5..vocab-1: no EOS, no <predict>), one document per row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (B, T + 1), generator=g)
    return Batch(tokens[:, :-1], tokens[:, 1:], torch.ones(B, T, dtype=torch.bool),
                 torch.zeros(B, T, dtype=torch.int32), torch.arange(T).expand(B, T))


CTX = StepContext(step=0, seed=0, training=True)


def train_step(model, opt, batch) -> float:
    t0 = time.perf_counter()
    loss, _ = model(batch, CTX)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


# -- train ----------------------------------------------------------------------------------------------
def rounds_of(names: list[str], rounds: int):
    """The order of each round: forwards, then backwards, and so on (drift in the machine's load then
    favours no model)."""
    for r in range(rounds):
        yield r, (names if r % 2 == 0 else names[::-1])


def paired(times: dict, n: str, ref: str = "standard") -> float:
    """The median over rounds of n's time / ref's time in the same round."""
    return statistics.median(x / y for x, y in zip(times[n], times[ref]))


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_train(a, models: dict) -> None:
    batch = batch_of(a.batch, a.seq, a.vocab)
    opts = {n: adamw(m) for n, m in models.items()}
    for n, m in models.items():  # warm-up: allocator, optimizer state, compilation when --compile
        train_step(m, opts[n], batch)
    times = {n: [] for n in models}
    print(f"train ({load()}):", flush=True)
    for r, order in rounds_of(list(models), a.rounds):
        for n in order:
            times[n].append(train_step(models[n], opts[n], batch))
        print(f"  round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:,.0f} ms" for n, t in times.items()),
              flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    best = {n: min(t) for n, t in times.items()}
    tokens = a.batch * a.seq
    print(f"\n# training step (forward + backward + fused AdamW), d={a.d_model} L={a.layers} H={a.heads} "
          f"FFN={3 * a.d_model} vocab {a.vocab}, T={a.seq} input tokens (SPS: {2 * a.seq} slots), w={a.window}, "
          f"micro-batch {a.batch} ({tokens} input tokens/step), fp32, {'compiled' if a.compile else 'eager'}, "
          f"{torch.get_num_threads()} threads; {a.rounds} alternating rounds ({load()})")
    print("# x Std: median over rounds of the ratio to Standard's step in the same round; by median / by min: the "
          "ratio of the medians / of the fastest steps")
    print(f"{'model':<15} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'us/token':>9} {'tokens/s':>9} "
          f"{'x Std':>7} {'by median':>10} {'by min':>7}")
    for n in models:
        t = times[n]
        print(f"{n:<15} {med[n] * 1e3:>10,.0f} {best[n] * 1e3:>8,.0f} {max(t) * 1e3:>8,.0f} "
              f"{med[n] / tokens * 1e6:>9.0f} {tokens / med[n]:>9,.0f} {paired(times, n):>6.2f}x "
              f"{med[n] / med['standard']:>9.2f}x {best[n] / best['standard']:>6.2f}x")
    flops = {n: get_arch("baseline" if n == "standard" else "sps").flops_per_token(models[n].cfg, a.seq, None)
             for n in ("standard", "sps")}
    print(f"FLOP model (the registry's flops_per_token, dense attention): Standard {flops['standard'] / 1e6:.0f}, "
          f"SPS {flops['sps'] / 1e6:.0f} MFLOP per input token, {flops['sps'] / flops['standard']:.2f}x")
    print(f"RATIO SPS/Standard step time per input token = {paired(times, 'sps'):.2f}x (by min "
          f"{best['sps'] / best['standard']:.2f}x; target <= 2.3x, aim 2.0x)")
    if a.profile:
        profile("one training step each", {n: lambda n=n: train_step(models[n], opts[n], batch)
                                            for n in ("sps", "standard")})


def profile(what: str, run: dict) -> None:
    """run: {"sps": fn, "standard": fn}, each run once under torch.profiler; prints the self CPU time of
    the ops that take the most in SPS, next to Standard's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    tables = {}
    for n in ("sps", "standard"):
        with prof(activities=[ProfilerActivity.CPU]) as p:
            run[n]()
        tables[n] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in p.key_averages()}
    sps, std = tables["sps"], tables["standard"]
    total_sps, total_std = sum(v[0] for v in sps.values()), sum(v[0] for v in std.values())
    print(f"\n# torch.profiler, {what}: self CPU ms by op (SPS total {total_sps:,.0f} ms, Standard "
          f"{total_std:,.0f} ms), the 15 largest in SPS")
    print(f"{'op':<58} {'SPS ms':>9} {'share':>6} {'calls':>6} {'Std ms':>9} {'x Std':>7}")
    for key, (ms, calls) in sorted(sps.items(), key=lambda kv: -kv[1][0])[:15]:
        s = std.get(key, (0.0, 0))[0]
        print(f"{key[:58]:<58} {ms:>9,.1f} {ms / total_sps:>6.1%} {calls:>6} {s:>9,.1f} "
              f"{(f'{ms / s:.2f}x' if s else '-'):>7}")


# -- decode ---------------------------------------------------------------------------------------------
def decode(model, spec, prompt, n: int) -> tuple[float, float]:
    """(prefill seconds, one-token steps per second x batch), greedy, internal tokens never chosen."""
    never = sorted(spec.internal_tokens(model.cfg).values())
    never = torch.tensor(never, dtype=torch.long)
    with torch.no_grad():
        t0 = time.perf_counter()
        state = spec.new_state(model, prompt.shape[0])
        logits, state = spec.step(model, prompt, state)
        t1 = time.perf_counter()
        for _ in range(n):
            last = logits[:, -1]
            if len(never):
                last = last.index_fill(-1, never, float("-inf"))
            logits, state = spec.step(model, last.argmax(-1, keepdim=True), state)
        t2 = time.perf_counter()
    return t1 - t0, prompt.shape[0] * n / (t2 - t1)


def bench_decode(a, models: dict) -> None:
    specs = {n: get_arch("baseline" if n == "standard" else "sps") for n in models}
    for m in models.values():
        m.eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, a.vocab, (a.decode_batch, a.prompt_tokens), generator=g)
    for n, m in models.items():  # warm-up
        decode(m, specs[n], prompt, 4)
    res = {n: [] for n in models}
    print(f"decode ({load()}):", flush=True)
    for _, order in rounds_of(list(models), a.rounds):
        for n in order:
            res[n].append(decode(models[n], specs[n], prompt, a.decode_tokens))
    prefill = {n: [p for p, _ in r] for n, r in res.items()}
    step = {n: [a.decode_batch / t for _, t in r] for n, r in res.items()}  # seconds per one-token step
    print(f"\n# decode, batch {a.decode_batch}: a {a.prompt_tokens}-token prompt prefilled, then {a.decode_tokens} "
          f"one-token steps (greedy), same models, fp32, {'compiled' if a.compile else 'eager'}, "
          f"{torch.get_num_threads()} threads; {a.rounds} alternating rounds, medians; x Std: median of the "
          f"per-round ratios ({load()})")
    print(f"{'model':<15} {'params':>8} {'prefill ms':>11} {'x Std':>7} {'tokens/s':>9} {'ms/step':>8} "
          f"{'best tok/s':>11} {'x Standard':>11}")
    for n in models:
        params = count_parameters(models[n])["total"] / 1e6
        s_med = statistics.median(step[n])
        print(f"{n:<15} {params:>7.1f}M {statistics.median(prefill[n]) * 1e3:>11.0f} {paired(prefill, n):>6.2f}x "
              f"{a.decode_batch / s_med:>9.1f} {s_med * 1e3:>8.1f} {a.decode_batch / min(step[n]):>11.1f} "
              f"{1 / paired(step, n):>10.2f}x")
    print(f"RATIO SPS/Standard decode tokens/s = {1 / paired(step, 'sps'):.2f}x (paper, GPU: 0.90-0.95x)")
    if a.profile:
        profile(f"prefill + {a.decode_tokens} decode steps each",
                {n: lambda n=n: decode(models[n], specs[n], prompt, a.decode_tokens) for n in ("sps", "standard")})
    for m in models.values():
        m.train()


# -- memory ---------------------------------------------------------------------------------------------
MEMORY_CONFIGS = (("standard", "none"), ("sps", "none"), ("sps", "full"))


def memory_child(a) -> None:
    """One configuration in this process; prints JSON: the activation peak of one full step."""
    model = build(a, a.model)
    if a.policy != "none":
        spec = get_arch("baseline" if a.model == "standard" else "sps")
        spec.recompute_policies()[a.policy].apply(model)  # parallel/recompute.py, as the trainer applies it
    opt = adamw(model)
    small = batch_of(1, 1, a.vocab)
    model(small, CTX)[0].backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradient buffers: they are not activations
    batch = batch_of(a.batch, a.seq, a.vocab)
    before = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    model(batch, CTX)[0].backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    step_s = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024
    print(json.dumps({"activation_mb": (peak - before) / 2**20, "before_mb": before / 2**20, "step_s": step_s}))


def bench_memory(a) -> None:
    env = dict(os.environ, MALLOC_ARENA_MAX="1", PRETRAIN_MALLOC="system")
    env.pop("LD_PRELOAD", None)  # glibc malloc: freed memory leaves RSS, so the peak is the step's own
    env.pop("PRETRAIN_MALLOC_APPLIED", None)
    res = {c: [] for c in MEMORY_CONFIGS}
    for _ in range(a.mem_rounds):
        for model, policy in MEMORY_CONFIGS:
            cmd = [sys.executable, __file__, "_memory_child", "--model", model, "--policy", policy,
                   "--threads", str(a.threads), "--d-model", str(a.d_model), "--layers", str(a.layers),
                   "--heads", str(a.heads), "--vocab", str(a.vocab), "--seq", str(a.seq), "--window", str(a.window),
                   "--batch", str(a.batch)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            res[(model, policy)].append(json.loads(out.strip().splitlines()[-1]))
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in res.items()}
    none = med[("sps", "none")]["activation_mb"]
    std = med[("standard", "none")]["activation_mb"]
    print(f"\n# peak activation memory of one training step (peak RSS of the step minus RSS before it, weights, "
          f"gradients and AdamW moments already allocated), micro-batch {a.batch}, T={a.seq}, fresh process per "
          f"configuration under glibc malloc; median of {a.mem_rounds} processes each. For scale: one fp32 logits "
          f"tensor [B, T, V] is {a.batch * a.seq * a.vocab * 4 / 2**20:,.0f} MB, the same for both models")
    print(f"{'model':<10} {'recompute':<24} {'RSS before MB':>14} {'activation MB':>14} {'x SPS none':>11} "
          f"{'x Std':>7} {'1 step s':>9}")
    for (model, policy), m in med.items():
        label = policy if policy == "none" else f"{policy} (every block)"
        print(f"{model:<10} {label:<24} {m['before_mb']:>14,.0f} {m['activation_mb']:>14,.0f} "
              f"{m['activation_mb'] / none:>10.2f}x {m['activation_mb'] / std:>6.2f}x {m['step_s']:>9.2f}")
    full = med[("sps", "full")]["activation_mb"]
    print(f"RATIO SPS recompute full/none activation memory = {full / none:.2f}x; SPS/Standard without "
          f"recompute = {none / std:.2f}x")


# -- tiles ----------------------------------------------------------------------------------------------
def bench_tiles(a) -> None:
    slots, bs = a.tile_slots, a.block
    T = slots // 2
    small = dict(vocab_size=64, d_model=64, n_layers=1, n_heads=1, max_seq_len=T, sps_window=a.window,
                 document_mask=True)
    spec = get_arch("sps")
    doc = torch.zeros(1, T, dtype=torch.int32)  # one document
    n = -(-slots // bs)
    causal_tri = n * (n + 1) // 2
    nt = -(-T // bs)
    std_tri = nt * (nt + 1) // 2
    print(f"\n# empty (query block, key block) tiles at 2T = {slots} slots (T={T}), block {bs}x{bs} ({n}x{n} = "
          f"{n * n} tiles, {causal_tri} in the causal lower triangle), w={a.window}, one document; computed = "
          f"tiles a block-sparse kernel must run; Standard's causal T x T: {std_tri} tiles")
    print(f"{'variant':<14} {'layout':<15} {'empty':>6} {'of all':>7} {'computed':>9} {'of causal':>10} "
          f"{'skipped vs causal':>18} {'x Std':>6}")
    for variant in VARIANTS:
        model = spec.build(spec.config_cls(variant=variant, **small))
        for interleaved in (False, True):
            mask = model.slot_mask(T, doc, interleaved=interleaved)
            empty = mask.empty_tiles(slots, slots, bs, bs)[0, 0]
            e, computed = int(empty.sum()), n * n - int(empty.sum())
            print(f"{variant:<14} {'interleaved' if interleaved else 'de-interleaved':<15} {e:>6} {e / (n * n):>7.1%} "
                  f"{computed:>9} {computed / causal_tri:>10.1%} {1 - computed / causal_tri:>18.1%} "
                  f"{computed / std_tri:>5.2f}x")
    print("(\"of causal\": computed tiles / the 2T x 2T lower triangle, the dense causal kernel's work in the "
          "interleaved layout; \"skipped vs causal\" = 1 - that; \"x Std\": computed tiles / Standard's T x T "
          "triangle)")


# -- main -----------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="all", choices=["all", "train", "decode", "memory", "tiles",
                                                             "_memory_child"],
                   help="the section to run (default all, in this order: train, decode, memory, tiles)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 round, micro-batch 1, decode batch 1 x 16 tokens (figures imprecise)")
    p.add_argument("--variants", action="store_true",
                   help="train also times SPS's delayed_state and 2x_memory variants (about +80%% train time)")
    p.add_argument("--profile", action="store_true",
                   help="train and decode: a torch.profiler table of one step / one decode run of each model")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (default: eager)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (torch.set_num_threads)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds for train and decode (medians)")
    p.add_argument("--batch", type=int, default=8, help="training micro-batch in sequences (train and memory)")
    p.add_argument("--seq", type=int, default=256, help="T, input tokens per sequence (SPS runs 2T slots)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--window", type=int, default=64, help="sps_window w (train, decode, memory, tiles)")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=128, help="one-token steps timed per round")
    p.add_argument("--mem-rounds", type=int, default=1, help="fresh processes per memory configuration")
    p.add_argument("--tile-slots", type=int, default=4096, help="2T for the tile count")
    p.add_argument("--block", type=int, default=128, help="tile size (query block = key block)")
    p.add_argument("--model", default="sps", help=argparse.SUPPRESS)  # _memory_child
    p.add_argument("--policy", default="none", help=argparse.SUPPRESS)  # _memory_child
    a = p.parse_args()
    if a.quick:
        a.rounds, a.batch, a.decode_batch, a.decode_tokens, a.mem_rounds = 1, 1, 1, 16, 1
    torch.set_num_threads(a.threads)
    if a.what == "_memory_child":
        return memory_child(a)
    from pretrain.malloc import active_allocator, use_caching_allocator

    use_caching_allocator()  # as `pretrain train` does (may re-execute this script once)
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, allocator {active_allocator()} "
          f"(memory children: glibc malloc)", flush=True)
    if a.what in ("all", "train", "decode"):
        names = ["standard", "sps"] + (["delayed_state", "2x_memory"] if a.variants and a.what != "decode" else [])
        max_len = max(a.seq, a.prompt_tokens + a.decode_tokens + 1)
        models = {n: build(a, n, max_len) for n in names}
        if a.what in ("all", "train"):
            bench_train(a, models)
        if a.what in ("all", "decode"):
            bench_decode(a, {n: models[n] for n in ("standard", "sps")})
        del models
    if a.what in ("all", "memory"):
        bench_memory(a)
    if a.what in ("all", "tiles"):
        bench_tiles(a)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
