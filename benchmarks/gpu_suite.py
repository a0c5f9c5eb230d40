"""The GPU suite: every architecture's paper config trained by the real `pretrain train` on one GPU, with
Hugging Face's Llama beside the baseline, in two parts of a few minutes each (GPU time comes in short
windows: run one part before a change and again after it).

    bash benchmarks/gpu_suite.sh --part transformer --out /tmp/suite        # on the GPU machine
    python benchmarks/gpu_suite.py --part all --dry-run --out /tmp/suite    # CPU, tiny shapes (CI)

Parts:
  transformer  baseline/s with and without document masks (compiled whole and block by block, and with the
               masks through SDPA's dense mask, forced) and HF Llama at its shape, baseline/m,
               sps/s, cart/d1024-r6 and its Dense partner dense-7l, crt/owt-crt-d5-c1024 and the
               RoFormer of its width (owt-roformer-n12-c1024)
  serial       rt/300m-12l eager and with train.cuda_graphs (at micro 64 and the paper's 512), rt/t-300m-12l,
               gpn/gpn-m-130m eager and with graphs (at micro 8 and 128); --only picks rows
  checks       the CUDA checks of benchmarks/gpu_sps_rt.py and gpu_gpn.py (CPU agreement, decode equal to
               the forward, RT's tiled prefill against the naive loop, GPN's segment recompute), PASS/FAIL
               per check; the compiled-vs-eager and kernel checks are pytest's: `pytest -m gpu`

Each row is a subprocess `pretrain train` on data the suite writes itself (random tokens in documents
of ~1,000 tokens, with a small tokenizer.json naming the special tokens), one micro batch per step,
constant lr, log_every=1. Figures are medians over the steps after --warmup: input tokens/s, TFLOP/s
and MFU by the registry's flops_per_token, the peak memory the trainer logs beside the planner's estimate for
the run (pretrain/plan.py's rank_bytes at that micro batch, bf16 on a GPU), compile time (the first
step's time beyond a steady step), and the attention path that ran. Each row has a time cap (--cap);
a row that passes it is marked and the suite goes on. A run trains to one step past its timed ones, and on
a GPU it is stopped once its last timed step is recorded (the end-of-run evaluation, a second compile, and
the checkpoint would measure nothing); a SIGTERM to the suite (gpu_session.sh's `timeout`) ends the running
row's processes too. The table is written to OUT/suite_<part>.md
(and .json) and, with --append FILE, appended to FILE with the device, torch, Triton, commit and date.
--warm-jobs N first trains every row (and the HF twin) for one step, N runs at once within the planner's
memory, to fill inductor's caches; the timed runs then follow one at a time on a quiet GPU and load their
graphs from those caches, and the compile column gives both times (benchmarks/suite_warm.py).
A row that runs out of memory through fragmentation (its out-of-memory sentence says so: enough memory
reserved by the allocator, not in one piece) runs once more with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
as "<row> expandable", which then stands for it in the ratios.
--profile ROW captures a torch.profiler table of a few steps of that row (OUT/profile_<row>.txt).
--dry-run checks every row's real config and overrides, then trains each architecture's tiny config
for a few steps on the CPU through the same machinery (the HF row at the tiny width).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from suite_table import header, ratios, table  # noqa: F401  (table: the tests read it here)
from suite_warm import Job, compile_cache, compile_phases, first_compile, forget_autotuning, inductor_cache, run_many

ROOT = Path(__file__).resolve().parent.parent
EOD, PREDICT = 2, 4  # the suite's tokenizer: <unk> <s> </s> <pad> <predict>, then ordinary tokens
DRY_MICRO, DRY_T = 2, 32  # a dry run's micro batch and sequence length: seconds per row on a CPU


@dataclass
class Row:
    name: str
    config: str
    overrides: list[str] = field(default_factory=list)
    micro: int = 0  # sequences per micro batch (= per step); 0: the config's
    compile: bool = True  # False: eager although the config compiles (the note says why)
    note: str = ""
    hf: bool = False  # Hugging Face Llama at this row's shape, same batch, run right after it
    env: dict = field(default_factory=dict)  # environment of the run (a forced kernel path); not in a dry run
    memory_trace: bool = False  # the allocator's record of its untimed warm-up steps (pretrain/memory_trace.py)
    cap_x: float = 1.0  # its cap is --cap times this: a document-masked first step also measures the attention
    # paths, FlexAttention's compile included (the H200 took 94 s to its first masked step, 35 s unmasked)


NOMASK = ["model.document_mask=false"]
GRAPHS, GRAPHS_OFF = ["train.cuda_graphs=on"], ["train.cuda_graphs=off"]
BLOCKS = ["train.compile_scope=blocks"]
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
PARTS = {
    "transformer": [
        Row("baseline/s no-mask", "baseline/s", NOMASK, hf=True, note="plain causal: like for like with HF"),
        Row("baseline/s", "baseline/s", cap_x=2),
        Row("baseline/m no-mask", "baseline/m", NOMASK),
        Row("sps/s", "sps/s", [f"model.predict_id={PREDICT}", f"model.eos_id={EOD}"], cap_x=2),
        Row("cart/d1024-r6", "cart/d1024-r6", micro=32),
        Row("cart/dense-7l", "cart/dense-7l", micro=32),
        Row("crt/owt-crt-d5-c1024", "crt/owt-crt-d5-c1024", micro=64),
        Row("crt/owt-roformer-n12-c1024", "crt/owt-roformer-n12-c1024", micro=64),
        Row("baseline/s sdpa", "baseline/s", env={"PRETRAIN_KERNELS": "attention=sdpa"}, cap_x=2,
            note="document masks through SDPA's dense mask (forced): the automatic path must not be slower (issue 34)"),
        # last, so the targets are measured first when the part runs short of time
        Row("baseline/s no-mask blocks", "baseline/s", [*NOMASK, *BLOCKS], note="train.compile_scope=blocks: compile time "
            "and step time against whole-model compile (the first row)"),
        Row("baseline/s blocks", "baseline/s", BLOCKS, cap_x=2, note="the same with document masks (94 s to compile whole on the H200)"),
    ],
    "serial": [  # train.compile compiles RT's per-position pieces, not its loops (tracing those took minutes)
        Row("rt/300m-12l", "rt/300m-12l", GRAPHS_OFF, micro=64, note="micro batch 64 of the recipe's 512"),
        Row("rt/300m-12l graphs", "rt/300m-12l", GRAPHS, micro=64, note="each layer's loop a CUDA graph (issue 37)"),
        # cap_x: a 512-sequence step took about 34 s at the H200's 7.8k tokens/s, and six steps run (with the compile)
        Row("rt/300m-12l graphs b512", "rt/300m-12l", GRAPHS, micro=512, cap_x=2.5,
            note="the paper's 512 x 512 tokens a step"),
        Row("rt/300m-12l graphs b512 triton", "rt/300m-12l", GRAPHS, micro=512, cap_x=2.5,
            env={"PRETRAIN_KERNELS": "rt_prefill=triton"},
            note="the Triton tile (forced): automatic where it beats the PyTorch tile (issue 37)"),
        Row("rt/t-300m-12l", "rt/t-300m-12l", micro=32),
        Row("gpn/gpn-m-130m", "gpn/gpn-m-130m", GRAPHS_OFF, micro=8),
        Row("gpn/gpn-m-130m graphs", "gpn/gpn-m-130m", GRAPHS, micro=8, note="each segment body a CUDA graph"),
        # its warm-up steps recorded by the allocator: the planner gives 35.8 GiB, the H200 held 45.7 (11-29)
        Row("gpn/gpn-m-130m graphs b128", "gpn/gpn-m-130m", GRAPHS, micro=128, memory_trace=True,
            note="the whole 128-sequence batch in one micro batch (issue 37)"),
        Row("gpn/gpn-130m graphs b128", "gpn/gpn-130m", GRAPHS, micro=128, note="bare GPN, beside GPN+M (issue 37)"),
        Row("gpn/gpn-m-2l-130m graphs b128", "gpn/gpn-m-2l-130m", GRAPHS, micro=128, note="GPN+M with two layers"),
    ],
}


# -- data -------------------------------------------------------------------------------------
def write_data(folder: Path, vocab: int, tokens: int, seed: int = 0) -> tuple[str, str]:
    """A .bin/.idx corpus of random tokens in documents of ~1,000 tokens (exponential lengths), and a
    tokenizer.json whose special tokens give the trainer its EOD. Ids stay below `vocab`."""
    import numpy as np

    from data_tools.indexed import IndexedWriter

    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / f"random_v{vocab}_{tokens}"
    if not Path(f"{prefix}.idx").exists():
        rng = np.random.default_rng(seed)
        dtype = np.uint16 if vocab <= 65535 else np.int32
        with IndexedWriter(str(prefix), dtype) as w:
            left = tokens
            while left > 0:
                n = min(left, max(16, int(rng.exponential(1000))))
                w.add_document(np.append(rng.integers(PREDICT + 1, vocab, n - 1), EOD).astype(dtype))
                left -= n
    tok = folder / "tokenizer.json"
    if not tok.exists():
        from tokenizers import Tokenizer, models

        specials = ["<unk>", "<s>", "</s>", "<pad>", "<predict>"]
        vocab_map = {t: i for i, t in enumerate(specials + [f"t{i}" for i in range(59)])}
        t = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
        t.add_special_tokens(specials)
        t.save(str(tok))
    return str(prefix), str(tok)


# -- one row ----------------------------------------------------------------------------------
def fresh_run_dir(out: Path, name: str) -> Path:
    """The run directory of row `name` under `out`, emptied. A second suite into the same folder (before
    and after a change, on one warm machine) would otherwise resume the first one's finished run and
    train nothing, or be stopped at once by the first run's metrics.jsonl, and report the old figures."""
    run_dir = out / "runs" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir


def row_overrides(row: Row, micro: int, steps: int, data: str, tok: str, run_dir: Path, dry: bool) -> list[str]:
    from pretrain.optim import TOKEN_FIELDS

    out = [*row.overrides, f"data.train=[{data}]", "data.valid=[]", "data.split=98,2,0", f"data.tokenizer={tok}",
           # one step past the timed ones: the last timed step's record is written without the end-of-run
           # evaluation (a second compile, under no_grad), so a GPU row is stopped right after it
           f"data.cache_dir={run_dir.parent / 'cache'}", f"train.run_dir={run_dir}", f"train.max_steps={steps + 1}",
           f"train.global_batch_seqs={micro}", f"train.micro_batch_seqs={micro}", "train.log_every=1",
           "train.eval_every=0", "train.eval_batches=1", "schedule.kind=constant", "schedule.warmup_steps=0",
           f"checkpoint.every={steps + 1}", f"train.compile={str(row.compile and not dry).lower()}",
           # the other kinds' fields (RT's warmup_cosine start, the token-counted wsd's tokens): constant refuses them
           "schedule.warmup_start=0", *(f"schedule.{name}=0" for name in TOKEN_FIELDS)]
    if dry:  # seconds per row on a CPU: the machinery runs, not the model's size
        out = [o.replace("train.cuda_graphs=on", "train.cuda_graphs=auto") for o in out]  # a CPU captures nothing
        out += ["train.device=cpu", "data.num_workers=0", "log.peak_tflops=1.0", f"data.seq_len={DRY_T}"]
    return out


def check_gpu_overrides(row: Row, out: Path) -> None:
    """Load the row's paper config with every override its GPU run passes (a dry run trains the tiny
    config, so only this catches a paper config's field that the suite's settings contradict)."""
    from pretrain.config import load_config

    micro = row.micro or load_config(row.config, row.overrides, check_data=False).train.micro_batch_seqs
    load_config(row.config, row_overrides(row, micro, 3, str(out / "data"), str(out / "tokenizer.json"),
                                          out / "runs" / "check", dry=False), check_data=False)


def row_shape(row: Row, args):
    """(the config a row trains, it loaded, its micro batch, its sequence length): the paper config as the
    row says, or in a dry run its architecture's tiny config at DRY_MICRO x DRY_T."""
    from pretrain.config import load_config

    config = row.config.split("/")[0] + "/tiny" if args.dry_run else row.config
    cfg = load_config(config, row.overrides, check_data=False)
    if args.dry_run:
        return config, cfg, DRY_MICRO, DRY_T
    return config, cfg, row.micro or cfg.train.micro_batch_seqs, cfg.data.seq_len


def run_capped(cmd: list[str], cap: float, log_path: Path, stop=lambda: False, env=None) -> tuple[str, int, str, float]:
    """Run `cmd` in a process group of its own, its output to log_path, until it exits, `cap` seconds
    pass or stop() says so (then the group is killed): (how it ended: exit | cap | stop, its return
    code, its output, wall seconds)."""
    e = run_many([Job("run", cmd, log_path, cap, ROOT, stop, env or {})])["run"]
    return e.how, e.rc, e.log, e.wall_s


def last_line(log: str) -> str:
    return ([ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["(no output)"])[0][:200]


def memory_trace_lines(log: str) -> list[str]:
    """What a run's PRETRAIN_MEMORY_TRACE said in its log (pretrain/memory_trace.py), its prefix taken off."""
    return re.findall(r"^memory trace: (.*)$", log, re.M)


def row_run(row: Row, args, shape, data_for, out: Path, steps: int, prefix: str = "") -> tuple[list[str], dict, Path]:
    """What runs a row for `steps` steps: its command, its environment and its run directory (emptied);
    `shape`: row_shape's."""
    config, cfg, micro, _ = shape
    data, tok = data_for(cfg.model.vocab_size)
    run_dir = fresh_run_dir(out, prefix + row.name)
    overrides = row_overrides(row, micro, steps, data, tok, run_dir, args.dry_run)
    if args.dry_run:
        overrides = [o for o in overrides if not o.startswith(("model.predict_id", "model.eos_id"))]
    env = {} if args.dry_run else dict(row.env)
    if args.stacks_every:
        env["PRETRAIN_STACKS_EVERY"] = str(args.stacks_every)
    if row.memory_trace and not args.dry_run:  # the untimed steps only: recording slows a step (CUDA only)
        env["PRETRAIN_MEMORY_TRACE"] = str(args.warmup)
    return [sys.executable, "-m", "pretrain.cli", "train", config, *overrides], env, run_dir


def stopper(args, run_dir: Path, steps: int):
    """On a GPU a run is stopped once its step `steps` is recorded (it trains to steps + 1: the step after,
    the end-of-run evaluation, a second compilation under no_grad, and the checkpoint would spend the part's
    minutes measuring nothing). The dry run ends by itself, so the whole path is exercised on the CPU."""
    return lambda: not args.dry_run and last_step(run_dir / "metrics.jsonl") >= steps


def run_row(row: Row, args, data_for, out: Path) -> dict:
    check_gpu_overrides(row, out)  # the paper config takes the GPU run's whole override set, dry run or not
    shape = config, cfg, micro, seq_len = row_shape(row, args)
    steps = args.warmup + args.steps
    cmd, env, run_dir = row_run(row, args, shape, data_for, out, steps)
    if args.dry_run:
        same = (config, tuple(o for o in cmd if not o.startswith(("train.run_dir", "checkpoint.every"))))
        if same in args.dry_runs:  # rows that differ only in their micro batch train the same dry run once
            return {**args.dry_runs[same], "row": row.name, "config": row.config, "note": row.note}
    result = {"row": row.name, "config": row.config, "note": row.note, "compiled": row.compile and not args.dry_run,
              "micro": micro, "seq_len": seq_len, "planner_gib": planner_gib(cfg, micro, seq_len)}
    cap = args.cap * row.cap_x
    ended, rc, log, result["wall_s"] = run_capped(cmd, cap, out / f"log_{run_dir.name}.txt",
                                                  stop=stopper(args, run_dir, steps), env=env)
    result.update(read_metrics(run_dir / "metrics.jsonl", args.warmup, micro * seq_len, upto=steps))
    if ended == "stop":
        result["status"] = "ok"
    elif ended == "cap":
        done = result.get("last_step", 0)
        result["status"] = (f"ok (stopped at the {cap:.0f} s cap after its last step)" if done == steps
                            else f"cap {cap:.0f} s after step {done} of {steps}")
    else:
        result["status"] = "ok" if rc == 0 else f"rc {rc}"
    if result.get("zero_grads") and result["status"].startswith("ok"):
        result["status"] = "wrong: every step's gradient norm was 0 (left out of the ratios)"
    if traced := memory_trace_lines(log):
        result["memory_trace"] = traced
    paths = re.findall(r"kernels: (.*)", log)
    result["paths"] = paths[-1].strip() if paths else ""
    phases = compile_phases(log)
    if phases:
        result["compile_phases"] = phases
    warm = args.warmed.get(row.name)
    if warm:  # the first compile was the warm-up's: its time and phases, beside this run's from the caches
        result.update(first_compile(warm))
    if not result["status"].startswith("ok"):
        from pretrain.oom import FRAGMENTED

        result["error"] = last_line(log)
        result["fragmented"] = FRAGMENTED in log  # out of memory with enough reserved, not in one piece
    if args.dry_run:
        args.dry_runs[same] = result
    return result


def expandable(row: Row) -> Row | None:
    """The row again with the allocator's expandable segments, for a row that ran out of memory through
    fragmentation (its sentence says so); None where it already had them."""
    if "PYTORCH_CUDA_ALLOC_CONF" in row.env:
        return None
    return replace(row, name=row.name + " expandable", hf=False, env={**row.env, **EXPANDABLE},
                   note=f"{row.name} again after its fragmented out-of-memory, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def warm_up(rows: list[Row], args, data_for, out: Path) -> dict:
    """--warm-jobs N: every row, and its HF twin, trained for one step, N at once within the planner's memory
    (benchmarks/suite_warm.py says why and what keeps the timed figures honest). {row name: Ended}."""
    import torch

    jobs = []
    for row in rows:
        shape = _, cfg, micro, seq_len = row_shape(row, args)
        cmd, env, run_dir = row_run(row, args, shape, data_for, out, 1, prefix="warm_")
        gib = planner_gib(cfg, micro, seq_len)
        jobs.append(Job(row.name, cmd, out / f"log_{run_dir.name}.txt", args.cap * row.cap_x, ROOT,
                        stopper(args, run_dir, 1), env, gib))
        if row.hf:
            jobs.append(Job(hf_name(row), hf_command(row, args, shape, steps=1, warmup=1), out / "log_warm_hf.txt",
                            args.cap, ROOT, gib=gib))
    cuda = torch.cuda.is_available() and not args.dry_run
    budget = 0.85 * torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else float("inf")
    t0 = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] warm-up: {len(jobs)} runs, {args.warm_jobs} at once"
          + (f" within {budget:.0f} GiB planned" if cuda else ""), flush=True)
    done = run_many(jobs, args.warm_jobs, budget)
    forgot = forget_autotuning(inductor_cache())
    args.warm_note = (f"; a warm-up first ran each row for one step, {args.warm_jobs} at once ({time.perf_counter() - t0:.0f} s"
                      f", {forgot} autotuned configurations deleted after it): the compile column gives that first "
                      "compile (contended) / the timed run's from the caches it filled")
    for key, e in done.items():
        print(f"    warm {key}: {e.how} rc {e.rc}, {e.wall_s:.0f} s", flush=True)
    return done


def hf_name(row: Row) -> str:
    return f"HF Llama ({row.name})"


def planner_gib(cfg, micro: int, seq_len: int) -> float | None:
    """What the planner gives this run's one rank at its micro batch (pretrain/oom.py's estimate: the figure the
    out-of-memory sentence and `pretrain plan` show), beside the measured peak so a GPU run checks the
    estimate; None for an architecture without an activation estimate."""
    from pretrain.oom import estimate

    # the default schedule: memory does not depend on it, and a token-counted one (SPS's) refuses the new batch
    cfg = replace(cfg, train=replace(cfg.train, micro_batch_seqs=micro, global_batch_seqs=micro),
                  data=replace(cfg.data, seq_len=seq_len), schedule=type(cfg.schedule)())
    found = estimate(cfg, 1)
    return found.bytes / 2**30 if found.known else None


def last_step(path: Path) -> int:
    """The step of the last whole record in a run's metrics.jsonl (0 before the first)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (json.JSONDecodeError, ValueError, TypeError, AttributeError):
            continue  # a torn last line of a live run
    return 0


def read_metrics(path: Path, warmup: int, tokens_per_step: int, upto: int | None = None) -> dict:
    """Medians of the per-step records after `warmup` and up to step `upto` (each record's window is one step:
    log_every=1); compile time = the first step's time beyond a steady step's. A torn last line is skipped."""
    if not path.exists():
        return {}
    records = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("tokens_per_s") and (upto is None or r.get("step", 0) <= upto):
            records.append(r)
    if not records:
        return {}
    steady = records[warmup:] or records[-1:]
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    tps = med("tokens_per_s")
    split = {k: statistics.median(r.get("time_split", {}).get(k, 0.0) for r in steady)
             for k in steady[-1].get("time_split", {})}
    return {"steps": len(steady), "last_step": records[-1]["step"], "tokens_per_s": tps, "tflops": med("tflops"), "mfu": med("mfu"),
            "memory_gb": max(r.get("memory_gb", 0.0) for r in records), "loss": steady[-1].get("loss"),
            "compile_s": max(0.0, tokens_per_step / records[0]["tokens_per_s"] - tokens_per_step / tps),
            "time_split": split,
            # a step that learns nothing times nothing worth reporting (RT's and GPN's compiled runs on the H200,
            # 2026-11-30: the chunked loss's gradients were all 0 under torch 2.11, with a loss that looked fine)
            "zero_grads": all(r.get("grad_norm") == 0 for r in records)}


# -- Hugging Face Llama at the baseline's shape ---------------------------------------------------
def hf_row(config: str, overrides: list[str], micro: int, seq_len: int, steps: int, warmup: int, dry: bool) -> dict:
    """LlamaForCausalLM built from `config` through the export adapter, trained as our trainer trains:
    bf16 autocast on CUDA, fused AdamW, torch.compile, the same micro batch; host-timed steps, each ending in one sync (as the
    trainer's steps do)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrain.config import load_config
    from pretrain.metrics import device_peak_tflops
    from pretrain.models import get_arch

    cfg = load_config(config, overrides, check_data=False)
    m = cfg.model
    hf = get_arch(m.arch).hf.hf_config(m, "float32", None)
    device = torch.device("cpu" if dry else "cuda")
    model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa")).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    compiled = model if dry else torch.compile(model)
    T = seq_len
    tokens = torch.randint(PREDICT + 1, m.vocab_size, (micro, T), device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    times, t_first = [], 0.0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with autocast:  # use_cache=False: with it on, training builds a KV cache (copies of K and V per layer)
            loss = compiled(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # one sync per step, as the trainer's
        dt = time.perf_counter() - t0
        if i == 0:
            t_first = dt
        if i >= warmup:
            times.append(dt)
    step = statistics.median(times)
    flops = get_arch(m.arch).flops_per_token(m, T) * micro * T
    peak, _ = device_peak_tflops(device, 1.0 if dry else 0.0)
    return {"tokens_per_s": micro * T / step, "tflops": flops / step / 1e12,
            "mfu": flops / step / 1e12 / peak if peak else 0.0, "compile_s": max(0.0, t_first - step),
            "memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
            "loss": float(loss), "steps": steps, "paths": "HF sdpa", "status": "ok"}


def hf_command(row: Row, args, shape, steps: int, warmup: int) -> list[str]:
    """The subprocess that runs hf_row at the row's shape (row_shape's)."""
    config, _, micro, seq_len = shape
    spec = {"config": config, "overrides": row.overrides, "micro": micro, "seq_len": seq_len, "steps": steps,
            "warmup": warmup, "dry": args.dry_run}
    return [sys.executable, __file__, "--hf-row", json.dumps(spec)]


def run_hf(row: Row, args, out: Path) -> dict:
    _, _, micro, seq_len = shape = row_shape(row, args)
    result = {"row": hf_name(row), "config": row.config, "note": "transformers LlamaForCausalLM, "
              "compiled, fused AdamW" if not args.dry_run else "transformers LlamaForCausalLM",
              "compiled": not args.dry_run, "micro": micro, "seq_len": seq_len}
    ended, rc, log, result["wall_s"] = run_capped(hf_command(row, args, shape, args.steps, args.warmup), args.cap,
                                                  out / "log_hf.txt")
    if ended == "cap":
        return {**result, "status": f"cap {args.cap:.0f} s"}
    found = [ln for ln in log.splitlines() if ln.startswith("HF_RESULT ")]
    if rc or not found:
        return {**result, "status": f"rc {rc}", "error": last_line(log)}
    warm = args.warmed.get(hf_name(row))
    return {**result, **json.loads(found[-1][len("HF_RESULT "):]), **(first_compile(warm) if warm else {})}


# -- the CUDA checks ---------------------------------------------------------------------------------
CHECKS = ["gpu_sps_rt.py", "gpu_gpn.py"]


def run_checks(args, out: Path) -> int:
    """Each check script as a subprocess under the cap; its PASS/FAIL lines and timings into one file."""
    lines, ok = [header(args), ""], True
    for script in CHECKS:
        ended, rc, log, _ = run_capped([sys.executable, str(ROOT / "benchmarks" / script)], args.cap,
                                       out / f"log_{script[:-3]}.txt",
                                       env={"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
        status = f"cap {args.cap:.0f} s" if ended == "cap" else "ok" if rc == 0 else f"rc {rc}"
        failed = [ln for ln in log.splitlines() if ln.startswith("FAIL")]
        ok &= status == "ok" and not failed
        lines += [f"#### {script}: {status}, {len(failed)} failed", "", "```", log.strip()[-4000:], "```", ""]
    text = "\n".join(lines)
    (out / "suite_checks.md").write_text(text)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    return 0 if ok else 1


# -- profile ----------------------------------------------------------------------------------------
def profile_row(row: Row, args, data_for, out: Path) -> Path:
    """A torch.profiler table (by device time) of --profile-steps steps of `row`, trained in this process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    config, cfg, micro, _ = row_shape(row, args)
    data, tok = data_for(cfg.model.vocab_size)
    run_dir = fresh_run_dir(out, "profile_" + row.name)
    trainer = Trainer(load_config(config, row_overrides(row, micro, args.warmup + args.profile_steps, data, tok, run_dir,
                                                        args.dry_run)))
    cuda = torch.cuda.is_available() and not args.dry_run
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    step, done = trainer._optimizer_step, [0]
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path = out / f"profile_{run_dir.name[len('profile_'):]}.txt"

    def stepped(*a, **k):  # the capture holds the steps after the warm-up (compile) steps
        if done[0] == args.warmup:
            prof.start()
        result = step(*a, **k)
        done[0] += 1
        if done[0] == args.warmup + args.profile_steps:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
            path.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
            raise _Captured  # the rest of the run (its evaluation and checkpoint) would measure nothing
        return result

    trainer._optimizer_step = stepped
    try:
        trainer.fit()
    except _Captured:
        pass
    return path


class _Captured(Exception):
    """The profile is written: the profiled run ends here."""


def pick(rows: list[Row], only: list[str]) -> list[Row]:
    """The rows --only names: a row's exact name picks that row alone ("baseline/s", not its no-mask and
    blocks rows), anything else the rows whose names contain it ("cart": both CART rows)."""
    names, only = {r.name for r in rows}, [o for o in only if o]  # an empty one ("a;;b") names nothing
    return [r for r in rows if any(o == r.name if o in names else o in r.name for o in only)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*PARTS, "checks", "all"], default="transformer",
                   help="all: transformer and serial (checks runs alone)")
    p.add_argument("--out", default="", help="folder for the table, the logs and the runs (required)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    p.add_argument("--cap", type=float, default=150, help="seconds a run may take before it is stopped")
    p.add_argument("--stacks-every", type=float, default=20, metavar="S",
                   help="each run prints every thread's stack each S seconds until its first step is logged, so a "
                        "compile that runs long says where (PRETRAIN_STACKS_EVERY; 0: never)")
    p.add_argument("--only", action="append", default=[],
                   help="run only this row (a row's exact name), or the rows whose names contain it (repeatable)")
    p.add_argument("--profile", default="", help="also profile this row (a name from the parts)")
    p.add_argument("--profile-only", action="store_true", help="run the --profile capture alone, no table")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="steps the profile holds (1 for RT: its graphed step is about a million kernels, and the "
                        "profiler's own processing of two ran past the H200 session's 140 s)")
    p.add_argument("--append", default="", help="append the table to this markdown file (docs/gpu-results.md)")
    p.add_argument("--commit", default="", help="the commit to name (default: git rev-parse HEAD)")
    p.add_argument("--tokens", type=int, default=0, help="tokens of random data to write (default: enough)")
    p.add_argument("--dry-run", action="store_true", help="CPU, each architecture's tiny config, no compile")
    p.add_argument("--warm-jobs", type=int, default=0, metavar="N",
                   help="first train every row for one step, N runs at once, to fill the compile caches; the timed "
                        "runs follow one at a time and load their graphs from them (benchmarks/suite_warm.py)")
    p.add_argument("--hf-row", default="", help=argparse.SUPPRESS)  # internal: one HF run as a subprocess
    args = p.parse_args(argv)
    # `timeout` (gpu_session.sh) sends SIGTERM: end through SystemExit, so each row's process group is killed
    # (run_capped) rather than left training on the GPU into the next stage
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.dry_runs = {}  # a dry run's (config, overrides) -> its result
    args.warmed = {}  # --warm-jobs: a row's (or its HF twin's) warm-up run
    sys.path.insert(0, str(ROOT))
    if args.hf_row:
        print("HF_RESULT " + json.dumps(hf_row(**json.loads(args.hf_row))), flush=True)
        return 0
    args.cache_state = compile_cache()  # before any run fills it (an HF row's subprocess needs none)
    if not args.out:
        p.error("--out FOLDER is required: the table, the logs and the runs go there")
    if args.profile_steps < 1:
        p.error("--profile-steps must be at least 1")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must each be at least 1 (the first step compiles)")
    if args.warm_jobs < 0:
        p.error(f"--warm-jobs must be 0 (no warm-up) or more, got {args.warm_jobs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "checks":
        import torch

        if args.dry_run or not torch.cuda.is_available():
            p.error("--part checks needs a CUDA device (it has no dry run: the CPU halves are pytest's)")
        return run_checks(args, out)
    rows = [r for part, rs in PARTS.items() if args.part in (part, "all") for r in rs]
    if args.only:
        rows = pick(rows, args.only)
        if not rows:
            p.error(f"--only {' '.join(args.only)} names no row of --part {args.part}")
    if any(r.cap_x != 1 for r in rows):
        args.caps_note = " (" + ", ".join(f"{r.cap_x:g}x for {r.name}" for r in rows if r.cap_x != 1) + ")"
    if args.profile and not any(r.name == args.profile for r in rows):
        p.error(f"--profile {args.profile!r} is not a row of --part {args.part}: "
                + ", ".join(r.name for r in rows))
    tokens = args.tokens or (100_000 if args.dry_run else 4_000_000)
    made: dict[int, tuple[str, str]] = {}

    def data_for(vocab: int) -> tuple[str, str]:
        vocab = min(vocab, 50_000 if not args.dry_run else vocab)  # one corpus serves every row's vocabulary
        if vocab not in made:
            made[vocab] = write_data(out / "data", vocab, tokens)
        return made[vocab]

    if args.profile_only:
        if not args.profile:
            p.error("--profile-only needs --profile ROW")
        print(f"profile: {profile_row(next(r for r in rows if r.name == args.profile), args, data_for, out)}")
        return 0
    if args.warm_jobs:
        args.warmed = warm_up(rows, args, data_for, out)
    results = []

    def write() -> str:  # after every row: a run stopped from outside still leaves the rows it finished
        text = "\n\n".join([header(args), table(results), "\n".join(ratios(results))]).rstrip() + "\n"
        (out / f"suite_{args.part}.md").write_text(text)
        (out / f"suite_{args.part}.json").write_text(json.dumps(results, indent=1))
        return text

    for row in rows:
        print(f"[{time.strftime('%H:%M:%S')}] {row.name} ...", flush=True)
        results.append(run_row(row, args, data_for, out))
        r = results[-1]
        print(f"    {r['status']}: {r.get('tokens_per_s') or 0:,.0f} tokens/s, MFU {r.get('mfu') or 0:.1%}, "
              f"{r.get('memory_gb') or 0:.1f} GB, wall {r['wall_s']:.0f} s", flush=True)
        again = expandable(row) if r.get("fragmented") else None
        if again is not None:  # once: a window's minutes go further than a second call to find this out
            print(f"[{time.strftime('%H:%M:%S')}] {again.name} ...", flush=True)
            results.append({**run_row(again, args, data_for, out), "retry_of": row.name})
            print(f"    {results[-1]['status']}: {results[-1].get('tokens_per_s') or 0:,.0f} tokens/s", flush=True)
        if row.hf:
            results.append(run_hf(row, args, out))
            r = results[-1]
            print(f"    {r['row']}: {r['status']}: {r.get('tokens_per_s') or 0:,.0f} tokens/s", flush=True)
        write()
    text = write()
    print(text)
    if args.profile:
        print(f"profile: {profile_row(next(r for r in rows if r.name == args.profile), args, data_for, out)}")
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    return 0 if all(r.get("status", "").startswith("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
