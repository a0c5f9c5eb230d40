"""The training loop: one code path for every architecture and every parallel layout.

    Trainer(load_config("baseline/tiny")).fit()

Each optimizer step: set the lr from the stateless schedule, run the micro batches of one global
batch (gradient accumulation) through `model(batch, ctx)` (the contract of pretrain/models/base.py:
ctx carries the step and its seed), clip, step. Every `log_every` steps a progress line and a
metrics.jsonl record (the loss and the model's diagnostics, token-weighted over micro batches and
ranks; FLOPs summed step by step from the registry's formula); every `eval_every` steps a validation
pass; every `checkpoint.every` steps an atomic checkpoint. The data position is the count of
consumed samples, so a resumed run reads exactly the samples the uninterrupted run would have.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from kernels import captured, describe_paths_used, registry, reset_paths_used
from data_tools.files import atomic_write
from data_tools.storage import free_bytes, mb, storage_operation, tree_bytes
from parallel.apply import parallelize
from parallel.data_parallel import accumulation_steps, all_reduce_sum, dp_rank_and_size
from parallel.dist import detect_env, init_distributed, rank_logger
from parallel.engine import EngineSettings
from parallel.mesh import layout
from pretrain import compile_report, memory_trace, stack_samples
from pretrain.bad_steps import NonFiniteLossError  # noqa: F401  (raised from here; callers import it here)
from pretrain.bad_steps import BadSteps, data_position
from pretrain.checkpoint import latest_checkpoint, load_latest, read_meta, save_checkpoint
from pretrain.config import RunConfig, config_summary, to_yaml
from pretrain.data import Collator, GlobalBatchSampler
from pretrain.data.build import check_internal_tokens, check_vocab, train_dataset, valid_dataset
from pretrain.init_from import load_initial_weights
from pretrain.kernel_probe import check_forced_paths
from pretrain.malloc import allocator_note
from pretrain.metrics import MetricsLog, WandbLogger, device_peak_tflops, memory_gb, progress_line
from pretrain.models import count_parameters, get_arch, meta_model
from pretrain.models.base import EVAL, StepContext
from pretrain.oom import step_memory_guard
from pretrain.optim import build_optimizer, lr_at
from pretrain.phase_timer import PhaseTimer
from pretrain.preemption import StopOnSignal, StopRequested, sigint_deferred
from pretrain.runlock import hold_run_dir
from pretrain.runs import make_absolute
from pretrain.tasks import accuracy_line


def resolve_device(train) -> torch.device:
    if train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is available")
    return torch.device(train.device)


def autocast_dtype(train, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPUs by default; fp32 on CPU, where bf16 matmuls are ~5x slower; none with fp64."""
    precision = train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def param_dtype(train) -> torch.dtype:
    """The weights' dtype: float64 under train.precision=fp64 (numerical checks), float32 otherwise."""
    return torch.float64 if train.precision == "fp64" else torch.float32


def _refuse_imported(run_dir: str) -> None:
    """A directory `pretrain import` wrote holds weights without an optimizer: it is started from, not
    resumed (resuming would also let retention delete the imported weights)."""
    path = latest_checkpoint(run_dir, log=lambda _: None)
    if path is not None and read_meta(path).get("imported_from"):
        from pretrain.export.importer import finetune_command

        raise ValueError(f"{run_dir} holds imported weights (pretrain import), not a run to resume; fine-tune them "
                         f"in a new run: {finetune_command(run_dir)}")


def collator_for(data) -> Collator:
    """The collate function a DataConfig asks for (the tokenizer's EOD and pad ids, position and mask options;
    a synthetic task's own collator)."""
    if data.task:
        from pretrain.tasks import TaskCollator

        return TaskCollator()
    eod_id = pad_id = None
    if data.tokenizer:
        from data_tools.tokenizer import load_tokenizer

        tok = load_tokenizer(data.tokenizer)
        eod_id = tok.eod_id
        # no loss on a pad target (none in packed data; spec-001 §8.2), unless pad doubles as EOS, a target kept
        pad_id = tok.pad_id if tok.pad_id != eod_id else None
    return Collator(eod_id, data.reset_positions, data.mask_cross_document, pad_id)


def eager_on_recompile():
    """Compiled code runs where a graph it already has fits; anything else runs eagerly instead of being
    compiled (torch >= 2.6; earlier, as usual)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("eager_on_recompile") if set_stance is not None else nullcontext()


@torch.no_grad()
def evaluate_loss(model, dataset, num_samples: int, micro_batch: int, collate, device, autocast=nullcontext,
                  progress=None) -> dict:
    """Token-weighted mean loss (and diagnostics, as val_<name>) over samples [0, num_samples) of a
    validation dataset; with several data-parallel ranks each takes every n-th micro batch and the
    sums are reduced. progress(batches done, batches), when given, is called after each micro batch."""
    rank, size = dp_rank_and_size()
    was_training = model.training
    model.eval()
    sums, names = torch.zeros(2, dtype=torch.float64, device=device), []
    starts = list(range(rank * micro_batch, num_samples, micro_batch * size))
    # A rank left without a batch still runs one, weighted 0, so that every rank reduces the same
    # diagnostics (their names are known only from a forward).
    weight = 1.0 if starts else 0.0
    for start in (starts or [0]) if num_samples else []:
        batch = collate(dataset.get_many(range(start, min(num_samples, start + micro_batch)))).to(device)
        # a shorter last batch (a small validation set) runs eagerly rather than compiling the model once
        # more, for a shape that comes once per evaluation (on a GPU, a whole-model compile is a minute)
        with autocast(), eager_on_recompile() if batch.tokens.shape[0] < micro_batch else nullcontext():
            loss, diag = model(batch, EVAL)
        if not names and diag:  # loss x tokens, each diagnostic x tokens, tokens
            names = sorted(diag)
            sums = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)
        tokens = batch.loss_mask.sum().double() * weight
        sums += torch.stack([loss.double(), *(diag[n].double() for n in names), torch.ones_like(tokens)]) * tokens
        if progress is not None:
            progress(start // (micro_batch * size) + 1, len(starts))
    all_reduce_sum(sums, "validation loss")
    model.train(was_training)
    tokens = max(float(sums[-1]), 1.0)
    val_loss = float(sums[0]) / tokens
    out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": int(sums[-1])}
    out.update({f"val_{n}": float(sums[1 + i]) / tokens for i, n in enumerate(names)})
    return out


@dataclass(frozen=True)
class RunFacts:
    """What a metrics record states about the run besides its window."""

    tokens_per_step: int
    seq_len: int
    max_steps: int
    devices: int  # the whole layout's ranks (throughput per device divides by it)
    peak_tflops: float  # per device; 0: unknown (MFU 0)
    device: torch.device


@dataclass
class Window:
    """The steps since the last metrics record: this rank's share of their summed loss and
    diagnostics (reduced over ranks when the record is made), their FLOPs, where their time went
    (`timer`: data = fetching the micro batches and counting their tokens; optimizer = finish_grads
    with its clipping, the finiteness check, the step, zero_grad), and the lr and grad norm of the
    last of them."""

    loss: torch.Tensor
    t0: float  # perf_counter at the window's start
    timer: PhaseTimer
    diagnostics: dict = field(default_factory=dict)
    steps: int = 0
    flops: float = 0.0
    lr: float = 0.0
    grad_norm: torch.Tensor | None = None
    skipped: int = 0  # steps of the window whose update was skipped (pretrain/bad_steps.py)

    @classmethod
    def start(cls, device: torch.device, dtype: torch.dtype = torch.float32) -> "Window":
        return cls(loss=torch.zeros((), device=device, dtype=dtype), t0=time.perf_counter(),
                   timer=PhaseTimer(device))

    def add_diagnostics(self, diagnostics: dict, dp_size: int) -> None:
        for name, value in diagnostics.items():
            self.diagnostics[name] = self.diagnostics.get(name, 0.0) + value / dp_size

    def end_step(self, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, skipped: bool = False) -> None:
        self.loss += loss
        self.steps += 1
        self.skipped += skipped
        self.lr, self.grad_norm = lr, grad_norm

    def record(self, step: int, consumed: int, run: RunFacts) -> dict:
        """The metrics.jsonl record of the window ending at `step` (a collective: the sums are reduced)."""
        names = sorted(self.diagnostics)  # the loss and every diagnostic summed over ranks at once
        sums = all_reduce_sum(torch.stack([self.loss, *(self.diagnostics[n] for n in names)]), "logged loss")
        values = sums.tolist()  # a sync: the window's last step has run on the device, its events too
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        steps = max(self.steps, 1)
        tokens_per_s = steps * run.tokens_per_step / elapsed
        tflops = self.flops / elapsed / 1e12
        parts = dict(self.timer.resolve())
        # host-timed data can overlap the device's previous optimizer step: then "other" is 0 and the
        # parts are shares of their own sum
        parts["other"] = max(elapsed - sum(parts.values()), 0.0)
        total = max(sum(parts.values()), 1e-9)
        return {
            "step": step, "loss": values[0] / steps, "lr": self.lr, "grad_norm": float(self.grad_norm),
            **{n: v / steps for n, v in zip(names, values[1:])},
            "tokens_per_s": tokens_per_s, "tflops": tflops,  # the whole job's
            "tokens_per_s_per_device": tokens_per_s / run.devices, "tflops_per_device": tflops / run.devices,
            "mfu": tflops / run.devices / run.peak_tflops if run.peak_tflops else 0.0,  # the peak is per device
            "memory_gb": memory_gb(run.device), "step_s": elapsed / steps,
            "time_split": {k: v / total for k, v in parts.items()},  # shares of step_s, adding up to 1
            "eta_s": (run.max_steps - step) * elapsed / steps,
            "consumed_samples": consumed, "tokens": consumed * run.seq_len,
            "skipped_steps": self.skipped,  # in this window; the run's total is added by the trainer
        }


def _close_loader(batches) -> None:
    """End the loader's worker processes now: a failed step's traceback holds the iterator, which
    would keep its (persistent) workers until the exception is gone."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # a multiprocess iterator's
    if shutdown is not None:
        shutdown()


def _ignore_sigint(_worker_id: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Trainer:
    def __init__(self, cfg: RunConfig, log=print):
        make_absolute(cfg)  # the stored config must work from any directory (pretrain/runs.py)
        self.cfg = cfg
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        env = init_distributed(detect_env(), timeout_s=cfg.parallel.timeout_s)
        self.rank, self.world_size = env.rank, env.world_size
        self.log = rank_logger(t.run_dir if env.world_size > 1 else None, env, echo=log)
        self.n_micro = accumulation_steps(t.global_batch_seqs, t.micro_batch_seqs,
                                          env.world_size // (cfg.parallel.tp * cfg.parallel.pp),
                                          names=("train.global_batch_seqs", "train.micro_batch_seqs"))
        self.device = resolve_device(t)
        # PRETRAIN_MEMORY_TRACE=N: the allocator's record from here (before the model) to step N
        self.trace_steps = memory_trace.begin(self.device)
        self.amp_dtype = autocast_dtype(t, self.device)
        # a forced kernel path that cannot serve this model: one sentence before any work
        check_forced_paths(cfg.model, cfg.data.seq_len, self.device, param_dtype(t), self.amp_dtype, t.seed)
        self.spec = get_arch(cfg.model.arch)
        # CUDA graphs of the architecture's loops (kernels/captured.py): refused here when forced and impossible
        captured.reset()
        self.capture_line, capture = captured.check(t.cuda_graphs, self.device, *self.spec.captured_regions(cfg),
                                                    cfg.parallel.pp)
        self.capture_mode = t.cuda_graphs if capture else "off"
        self.run_dir = t.run_dir
        check_vocab(cfg.data.train + cfg.data.valid, cfg.model.vocab_size)
        if internal := self.spec.internal_tokens(cfg.model):
            check_internal_tokens(cfg.data.train + cfg.data.valid, internal)

        def build():
            torch.manual_seed(t.seed)
            return self.spec.build(cfg.model).to(self.device, param_dtype(t))  # initialised in fp32 either way

        # layout, recompute, compile, engine: in that order, in one place (parallel/apply.py)
        self.engine = parallelize(build, EngineSettings.from_run(cfg), lambda m: build_optimizer(m, cfg.optim),
                                  self.spec.recompute_policies().get(cfg.parallel.recompute), compile=t.compile,
                                  pipeline_split=lambda pp: self.spec.pipeline_split(cfg.model, pp),
                                  compile_scope=t.compile_scope)
        self.model, self.layout = self.engine.model, layout()
        self.dp_rank, self.dp_size = dp_rank_and_size()
        self.step, self.consumed = 0, 0
        self.collate = collator_for(cfg.data)
        self.train_data = train_dataset(cfg.data)
        self.valid_data, self.valid_samples = valid_dataset(cfg.data)
        self.flops_per_token = self.spec.flops_per_token(cfg.model, cfg.data.seq_len, None)  # expected; per step in the loop
        self.peak_tflops, self.peak_source = device_peak_tflops(self.device, cfg.log.peak_tflops)
        self.facts = RunFacts(cfg.tokens_per_step, cfg.data.seq_len, t.max_steps, self.layout.world,
                              self.peak_tflops, self.device)
        self.metrics = self.wandb = None  # rank 0's outputs while fit() runs
        self.last_saved, self.kernels_reported = 0, False
        self.bad_steps = BadSteps(t)  # which steps are skipped, when skipping stops the run

    # -- setup ---------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        if self.rank != 0:
            return
        with storage_operation("writing the run's config", self.run_dir):
            os.makedirs(self.run_dir, exist_ok=True)
            atomic_write(os.path.join(self.run_dir, "config.yaml"), to_yaml(self.cfg))
        if self.cfg.data.tokenizer:  # a run directory must be usable without the original data tree
            dest = os.path.join(self.run_dir, "tokenizer", os.path.basename(self.cfg.data.tokenizer))
            with storage_operation("copying the tokenizer", dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                if not (os.path.exists(dest) and os.path.samefile(dest, self.cfg.data.tokenizer)):  # resumed on it
                    shutil.copy2(self.cfg.data.tokenizer, dest + ".tmp")
                    os.replace(dest + ".tmp", dest)

    def _resume(self) -> None:
        """Continue the run's own latest checkpoint; without one, start from checkpoint.init_from's
        weights when it names some."""
        c = self.cfg.checkpoint
        if not c.resume:  # starting over would delete that run's checkpoints
            if (path := latest_checkpoint(self.run_dir, log=self.log)) is not None:
                raise ValueError(f"{self.run_dir} already holds checkpoints ({os.path.basename(path)}) and "
                                 "checkpoint.resume=false; choose another train.name or train.run_dir, or delete it")
            path = None
        else:
            _refuse_imported(self.run_dir)
            path, meta = load_latest(self.run_dir, self.engine, restore_rng=True, expect_arch=self.cfg.model.arch,
                                     verify=c.verify, log=self.log)
        if path is None:
            if c.init_from:
                self.log(load_initial_weights(self.cfg, self.engine, log=self.log))
            return
        self.step, self.consumed = int(meta["step"]), int(meta["consumed_samples"])
        self.bad_steps.load(meta.get("bad_steps"))
        self.log(f"resumed from {path}: step {self.step}, {self.consumed:,} samples consumed" +
                 (f" (checkpoint.init_from {c.init_from} is not read: the run has its own checkpoint)"
                  if c.init_from else ""))
        if (kept := registry.restore_choices(meta.get("kernel_choices"), device=self.device)) is not None:
            self.log(kept)

    def _loader(self):
        t, data = self.cfg.train, self.cfg.data
        sampler = GlobalBatchSampler(t.global_batch_seqs, t.micro_batch_seqs, self.dp_rank, self.dp_size,
                                     consumed_samples=self.consumed)
        kwargs = dict(num_workers=data.num_workers, pin_memory=self.device.type == "cuda")
        if data.num_workers:  # workers ignore Ctrl-C: the main process finishes its step with them
            kwargs.update(prefetch_factor=4, persistent_workers=True, worker_init_fn=_ignore_sigint)
        return iter(torch.utils.data.DataLoader(self.train_data, batch_sampler=sampler,
                                                collate_fn=self.collate, **kwargs))

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def save(self) -> str:
        """Checkpoint this step. Ctrl-C during it lands after it, with the step recorded as saved, so
        an interrupt ends as cleanly as between steps; a storage fault is a StorageError (the previous
        checkpoint stays latest) and a line warns when the next checkpoint may not fit."""
        meta = {"consumed_samples": self.consumed, "config": self.cfg.to_dict(),
                "tokenizer": os.path.basename(self.cfg.data.tokenizer) if self.cfg.data.tokenizer else None,
                "bad_steps": self.bad_steps.state(),  # the run of skips and outlier windows (bad_steps.py)
                "kernel_choices": registry.saved_choices()}  # measured kernel paths: a resume runs the same ones
        c = self.cfg.checkpoint
        with sigint_deferred():
            path = save_checkpoint(self.run_dir, self.step, self.engine, None, meta, c.keep_last, c.keep_every,
                                   checksums=c.verify)
            self.last_saved = self.step
        if self.rank == 0:
            size, free = tree_bytes(path), free_bytes(path)
            if free is not None and free < 2 * size:
                self.log(f"warning: {mb(free)} free on the filesystem of {self.run_dir}, and a checkpoint takes "
                         f"{mb(size)}: the next ones may not fit (free space, or lower checkpoint.keep_last)")
        return path

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        t = self.cfg.train
        n = min(t.eval_batches * t.micro_batch_seqs, self.valid_samples)
        out = evaluate_loss(self.engine.inference_model, self.valid_data, n, t.micro_batch_seqs, self.collate, self.device,
                            self._autocast)
        if self.cfg.data.task:  # a synthetic task also reports its accuracy per group (val_acc_<group>)
            from pretrain.tasks import evaluate_accuracy

            out.update(evaluate_accuracy(self.model, self.spec.logits, self.valid_data, n, t.micro_batch_seqs,
                                         self.device, self._autocast))
        return out

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to train.max_steps; return the last metrics record. Rank 0 holds the run directory's
        lock throughout (pretrain/runlock.py): a second trainer is refused before it writes there."""
        with hold_run_dir(self.run_dir, self.cfg.checkpoint.lock_timeout_s, log=self.log, device=self.device):
            return self._fit()

    def _fit(self) -> dict:
        t = self.cfg.train
        self._resume()
        if self.step >= t.max_steps:
            self.log(f"{self.run_dir} is already complete at step {self.step} (train.max_steps={t.max_steps}); "
                     "raise train.max_steps to train further")
            return {"step": self.step}
        self._prepare_run_dir()
        self._describe()
        self._open_outputs()
        batches = self._loader()
        self.last_saved, self.kernels_reported = self.step, False
        window, record = Window.start(self.device, param_dtype(self.cfg.train)), {}
        self.model.train()
        stop = StopOnSignal(t.stop_signals, announce=self.log)
        reset_paths_used()
        compiling = (compile_report.snapshot(), compile_report.measured_seconds()) if t.compile else None
        first = self.step
        try:
            stop.install()
            while self.step < t.max_steps:
                with step_memory_guard(self):  # out of memory: one sentence, nothing saved (pretrain/oom.py)
                    self._optimizer_step(batches, window)
                if self.trace_steps and self.step >= first + self.trace_steps:
                    self._end_trace(f"step {self.step} ended")
                if self._log_due():
                    record = self._log_window(window, compiling)
                    window = Window.start(self.device, param_dtype(self.cfg.train))
                self._checkpoint_or_stop(stop)
        except KeyboardInterrupt:  # a second Ctrl-C, or one before the handler is in place: no save (a
            # collective some ranks would not join), the latest checkpoint stays
            self.log(f"interrupted at step {self.step}; the next start resumes from step {self.last_saved}")
            raise
        finally:
            stop.restore()
            _close_loader(batches)
            self._close_outputs()
            if self.trace_steps:  # a run that ended first (its last step, an error, out of memory, a signal)
                self._end_trace(f"the run's last step ({self.step}) ended" if self.step >= t.max_steps
                                else f"the run stopped in step {self.step + 1}")
        return record

    def _end_trace(self, why: str) -> None:
        self.trace_steps = 0
        try:
            memory_trace.finish(self.run_dir, self.rank, self.world_size, self.log, why)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the run's own error, if any, is what matters
            self.log(f"{memory_trace.HEADER}: not written: {type(e).__name__}: {e}")

    def _optimizer_step(self, batches, window: Window) -> None:
        """One step: the scheduled lr, forward/backward, the step itself (or its skip), into `window`."""
        t = self.cfg.train
        lr = lr_at(self.step, t.max_steps, self.cfg.optim, self.cfg.schedule,
                   tokens_per_step=self.cfg.tokens_per_step)
        self.engine.set_lr(lr)
        window.timer.start()
        step_loss, grad_norm = self._forward_backward(batches, window)  # finish_grads: in "optimizer"
        grad_norm, skipped = self._step_or_skip(step_loss, grad_norm)
        window.timer.resolve()  # after _step_or_skip's sync: reads events that have completed
        self.engine.zero_grad()
        window.timer.mark("optimizer")
        self.step += 1
        self.consumed += t.global_batch_seqs
        window.end_step(step_loss, lr, grad_norm, skipped)

    def _forward_backward(self, batches, window: Window) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step's forward/backward over its micro batches; returns (loss, grad norm).

        Each micro batch's mean loss is weighted by its share of the global batch's target tokens
        (times dp_size, which the engine's gradient averaging divides out), so the gradient is that
        of the token-weighted mean over the global batch whatever the micro batch or rank count.
        The model's diagnostics get the same weights (without the gradient), summed into `window`.
        """
        ctx = StepContext.for_step(self.cfg.train.seed, self.step)
        micro = [next(batches).to(self.device, non_blocking=True) for _ in range(self.n_micro)]
        tokens = torch.stack([b.loss_mask.sum() for b in micro]).to(param_dtype(self.cfg.train))  # the loss's dtype
        total = all_reduce_sum(tokens.sum(), "target token count").clamp(min=1.0)
        weights = tokens * (self.dp_size / total)
        window.timer.mark("data")
        with captured.step(self.capture_mode, self.log):  # regions replayed as CUDA graphs when on
            loss_sum, diagnostics = self.engine.forward_backward(micro, weights, ctx, self._autocast, window.timer)
        window.add_diagnostics(diagnostics, self.dp_size)
        window.flops += self.spec.flops_per_token(self.cfg.model, self.cfg.data.seq_len, ctx) * \
            self.cfg.tokens_per_step
        return loss_sum / self.dp_size, self.engine.finish_grads(self.cfg.optim.grad_clip)

    def _step_or_skip(self, step_loss: torch.Tensor, grad_norm) -> tuple[torch.Tensor, bool]:
        """The optimizer step, or its skip (pretrain/bad_steps.py: a non-finite or outlier loss or grad
        norm; train.nan_policy, train.max_bad_steps); returns (the grad norm to log, skipped).

        One host sync per step: the loss summed over data-parallel ranks and the reduced global grad
        norm (the same on every rank, so every rank decides the same) come to the host together.
        A skipped step's gradients are dropped by the zero_grad that follows; the optimizer (moments,
        step count) is untouched. DeepSpeed knows the grad norm only inside its step, where its own
        overflow check skips a non-finite one: that skip is read back and judged like the others."""
        dtype = torch.promote_types(step_loss.dtype, torch.float32)  # fp64 runs keep every digit
        loss = all_reduce_sum(step_loss.detach().clone().to(dtype), "loss check") / max(self.dp_size, 1)
        values = torch.stack([loss, grad_norm.detach().to(loss.device, dtype)]) if grad_norm is not None \
            else loss.reshape(1)
        host = values.tolist()
        norm = host[1] if grad_norm is not None else None
        verdict = self.bad_steps.judge(self.step + 1, host[0], norm)
        if not verdict.skip:
            self.engine.step()
            if grad_norm is None:  # DeepSpeed: the norm is known now; its overflow check skipped a bad one
                grad_norm = self.engine.grad_norm_after_step()
                verdict = self.bad_steps.judge_after_step(self.step + 1, host[0], float(grad_norm))
        if verdict.skip:
            self.bad_steps.skipped(self.step + 1, verdict, self._data_position(), self.log)
            return (grad_norm if grad_norm is not None else loss), True
        self.bad_steps.good()
        return grad_norm, False

    def _data_position(self) -> str:
        """The samples the current step read (it has not advanced self.consumed yet)."""
        return data_position(self.train_data, self.consumed, self.cfg.train.global_batch_seqs)

    def _eval_due(self) -> bool:
        t = self.cfg.train
        return self.step == t.max_steps or bool(t.eval_every and self.step % t.eval_every == 0)

    def _log_due(self) -> bool:
        return self._eval_due() or self.step % self.cfg.train.log_every == 0

    def _log_window(self, window: Window, compiling: tuple | None = None) -> dict:
        """The window's metrics record (with a validation pass when one is due), written to
        metrics.jsonl and W&B on rank 0 and said in a progress line; returns it."""
        do_eval = self._eval_due()
        record = window.record(self.step, self.consumed, self.facts)
        record["skipped_total"] = self.bad_steps.total
        if do_eval:
            record.update(self.evaluate())
        if self.metrics is not None:
            self.metrics.write(record)
        if self.wandb is not None:
            self.wandb.log(record)
        if not self.kernels_reported:  # after the first logged step, once: which kernel paths ran
            self.kernels_reported = True
            stack_samples.stop()  # the first step's stack samples end (PRETRAIN_STACKS_EVERY)
            self.log(f"kernels: {describe_paths_used()}" + (f" | {graphs}" if (graphs := captured.summary()) else ""))
            if compiling is not None and (said := compile_report.line(self.step, *compiling)) is not None:
                self.log(said)  # where a compiled run's first step went (pretrain/compile_report.py)
        self.log(progress_line(record, self.cfg.train.max_steps, self.spec.progress) + (
            f" | val {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})" if do_eval else "")
            + (f" | {accuracy_line(record)}" if do_eval and self.cfg.data.task else ""))
        return record

    def _checkpoint_or_stop(self, stop: StopOnSignal) -> None:
        """A checkpoint at checkpoint.every and at the end; on an agreed stop signal, a checkpoint of
        the step just made (unless saved already) and StopRequested."""
        every, last = self.cfg.checkpoint.every, self.step == self.cfg.train.max_steps
        if last or (every and self.step % every == 0):
            self.save()
        if not last and stop.agreed(self.world_size > 1):
            if self.step > self.last_saved:
                self.save()
            raise StopRequested(self.step, stop.signame, stop.seconds_since_signal(), self.cfg.checkpoint.grace_s)

    def _open_outputs(self) -> None:
        """metrics.jsonl and, with log.wandb, a W&B run: rank 0's."""
        cfg, lead = self.cfg, self.rank == 0
        self.metrics = MetricsLog(self.run_dir, resume_step=self.step) if lead else None
        self.wandb = WandbLogger(self.run_dir, cfg.log.wandb_project, cfg.train.name, cfg.to_dict()) \
            if cfg.log.wandb and lead else None

    def _close_outputs(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.wandb is not None:
            self.wandb.close()

    def _describe(self) -> None:
        cfg = self.cfg
        counts = count_parameters(meta_model(cfg.model))  # the whole model, whatever this rank holds (TP, PP)
        if cfg.log.show_config:
            self.log(to_yaml(cfg).rstrip())
        else:
            for line in config_summary(cfg, self.run_dir):
                self.log(line)
        self.log(
            f"model {cfg.model.arch}: {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding); "
            f"{self.flops_per_token / 1e6:,.1f} MFLOP/token | batch {cfg.train.global_batch_seqs} sequences = "
            f"{cfg.tokens_per_step:,} tokens/step | {self.device}, "
            f"{'bf16 autocast' if self.amp_dtype else 'fp64' if cfg.train.precision == 'fp64' else 'fp32'}, {torch.get_num_threads()} threads | "
            f"peak {self.peak_tflops:.3f} TFLOP/s ({self.peak_source}) | {allocator_note()} | run dir {self.run_dir}"
        )
        p, lay = cfg.parallel, self.layout
        self.log(f"layout: {lay.world} rank(s) = tp {lay.tp}{' (+sp)' if lay.sp else ''} x dp {lay.dp}"
                 f"{f' x pp {lay.pp}' if lay.pp > 1 else ''} | "
                 f"{self.engine.describe()}{' | megatron-core layers' if lay.megatron_layers else ''}"
                 f"{' | activation recompute: ' + p.recompute if p.recompute != 'none' else ''}")
        if cfg.train.compile:
            scope = " (train.compile_scope=blocks)" if cfg.train.compile_scope == "blocks" else ""
            self.log(f"compiling the model{scope}: the first steps are slow (train.compile=false runs it eagerly)")
        if self.capture_line:
            self.log(self.capture_line)
