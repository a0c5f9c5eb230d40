"""What the user sees during training: progress lines, metrics.jsonl, MFU against a stated peak.

metrics.jsonl holds one JSON object per logged step. The keys `step`, `loss`, `lr`, `tokens_per_s`
(and `val_loss`, `val_ppl` on evaluation steps) are a stable interface: plots and checks read them.
`tokens_per_s` and `tflops` are the whole job's, `*_per_device` and `mfu` per device; a model's
diagnostics appear under their own names (`val_<name>` on evaluation steps). `step_s` is the wall
time per step and `time_split` its shares (adding up to 1): `data` (host clock), `forward`,
`backward`, `optimizer` (gradient clipping included; CUDA events on a GPU: pretrain/phase_timer.py)
and `other` (logging, checkpoints, whatever else the steps' wall time held).
"""
from __future__ import annotations

import json
import os
import platform
import time

from data_tools.files import atomic_write
from data_tools.storage import storage_operation

# Dense bf16 peak TFLOP/s of common training GPUs (vendor figures, no sparsity).
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0, "A10G": 125.0,
                   "L40S": 362.0, "L4": 121.0, "V100": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0}
_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "recurrent-pretrain")


def probe_cpu_peak_tflops(threads: int, seconds: float = 1.0) -> float:
    """fp32 matmul throughput of this machine with `threads` threads, measured once and cached.

    The cache key holds the host, CPU model and thread count, so a different machine re-probes.
    """
    import torch

    key = f"{platform.node()}-{_cpu_model()}-{threads}".replace("/", "_").replace(" ", "_")
    path = os.path.join(_CACHE_DIR, f"cpu-peak-{key}.json")
    try:
        with open(path) as f:
            return float(json.load(f)["tflops"])
    except (OSError, ValueError, KeyError):
        pass
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b  # warm up the kernels and the caches
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0) / 1e12)
    os.makedirs(_CACHE_DIR, exist_ok=True)
    atomic_write(path, json.dumps({"tflops": best, "threads": threads, "n": n}), fsync=False)  # a cache
    return best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_peak_tflops(device, configured: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s, where it came from) for MFU: the config's value, a GPU table, or a CPU probe."""
    import torch

    if configured > 0:
        return configured, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"{key} bf16 table"
        return 0.0, f"unknown GPU {name!r}; set log.peak_tflops"
    threads = torch.get_num_threads()
    return probe_cpu_peak_tflops(threads), f"fp32 matmul probe, {threads} threads"


class MetricsLog:
    """Appends one JSON object per record to `<run_dir>/metrics.jsonl`, flushed each time."""

    def __init__(self, run_dir: str, resume_step: int = 0):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        with storage_operation("opening the metrics", self.path):
            if resume_step == 0 and os.path.exists(self.path):
                os.replace(self.path, self.path + ".old")  # a fresh run: keep the previous file aside
            elif resume_step > 0:
                self._truncate_after(resume_step)
            self._f = open(self.path, "a")

    def _truncate_after(self, step: int) -> None:
        # Records past the checkpoint we resume from were made by the run that died; the resumed run
        # writes them again, so keep each step once.
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [ln for ln in f if ln.strip() and _step_of(ln) <= step]
        atomic_write(self.path, "".join(kept))

    def write(self, record: dict) -> None:
        with storage_operation(f"writing the metrics of step {record.get('step')}", self.path):
            self._f.write(json.dumps(record, sort_keys=False) + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:
        return 1 << 62  # a torn last line: dropped


def read_metrics(run_dir: str) -> list[dict]:
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    records = []
    with open(path) as f:
        for n, ln in enumerate(f, 1):
            try:
                records.append(json.loads(ln)) if ln.strip() else None
            except ValueError:
                raise ValueError(f"{path} line {n} is not a JSON record") from None
    return records


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def progress_line(r: dict, max_steps: int, diagnostics: tuple = ()) -> str:
    """One line per logged step: what a user watches to see if the run is healthy and fast. Speed is
    per device (tok/s, TFLOP/s, MFU against the device's peak), as one compares it across layouts;
    `diagnostics` names the model's diagnostics worth a place on the line (all are in metrics.jsonl)."""
    t = r["time_split"]
    extra = "".join(f" | {name} {r[name]:.4g}" for name in diagnostics if name in r)
    return (
        f"step {r['step']:>{len(str(max_steps))}}/{max_steps} | loss {r['loss']:.4f}{extra} | lr {r['lr']:.2e} | "
        f"gnorm {r['grad_norm']:.3f} | {r['tokens_per_s_per_device']:,.0f} tok/s/dev | "
        f"{r['tflops_per_device']:.2f} TFLOP/s/dev MFU {100 * r['mfu']:.1f}% | mem {r['memory_gb']:.2f} GB | "
        f"data {t['data']:.0%} fwd {t['forward']:.0%} bwd {t['backward']:.0%} opt {t['optimizer']:.0%} "
        f"other {t.get('other', 0.0):.0%} | "
        f"ETA {format_duration(r['eta_s'])}"
        + (f" | skipped {r['skipped_steps']} (run: {r['skipped_total']})" if r.get("skipped_total") else "")
    )


def memory_gb(device) -> float:
    """Peak accelerator memory, or this process's resident memory on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return 0.0


class WandbLogger:
    """Weights & Biases logging; offline unless WANDB_MODE says otherwise, so no network is needed
    (upload later with `wandb sync <run_dir>/wandb/offline-run-*`)."""

    def __init__(self, run_dir: str, project: str, name: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ValueError("log.wandb=true needs the wandb package: pip install wandb") from None
        import hashlib

        run_id = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:16]  # same run on resume
        self._run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir,
                               config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, record: dict) -> None:
        flat = {k: v for k, v in record.items() if not isinstance(v, dict)}
        flat.update({f"time_split/{k}": v for k, v in record.get("time_split", {}).items()})
        self._run.log(flat, step=record["step"])

    def close(self) -> None:
        self._run.finish()
