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

import torch

from kernels import paths_used, reset_paths_used
from parallel.apply import parallelize
from parallel.data_parallel import accumulation_steps, all_reduce_sum, dp_rank_and_size
from parallel.dist import detect_env, init_distributed, rank_logger
from parallel.engine import EngineSettings
from parallel.mesh import layout
from pretrain.checkpoint import latest_checkpoint, load_latest, read_meta, save_checkpoint
from pretrain.config import RunConfig, to_yaml
from pretrain.data import Collator, GlobalBatchSampler
from pretrain.data.build import check_vocab, train_dataset, valid_dataset
from pretrain.init_from import load_initial_weights
from pretrain.malloc import allocator_note
from pretrain.metrics import MetricsLog, WandbLogger, device_peak_tflops, memory_gb, progress_line
from pretrain.models import count_parameters, get_arch
from pretrain.models.base import EVAL, StepContext
from pretrain.optim import build_optimizer, lr_at
from pretrain.preemption import StopOnSignal, StopRequested
from pretrain.runs import make_absolute
from pretrain.tasks import accuracy_line


class NonFiniteLossError(RuntimeError):
    """The loss or the gradients became NaN/inf and train.nan_policy is stop."""


def resolve_device(train) -> torch.device:
    if train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is available")
    return torch.device(train.device)


def autocast_dtype(train, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPUs by default; fp32 on CPU, where bf16 matmuls are ~5x slower."""
    precision = train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def _refuse_imported(run_dir: str) -> None:
    """A directory `pretrain import` wrote holds weights without an optimizer: it is started from, not
    resumed (resuming would also let retention delete the imported weights)."""
    path = latest_checkpoint(run_dir, log=lambda _: None)
    if path is not None and read_meta(path).get("imported_from"):
        from pretrain.export.importer import finetune_command

        raise ValueError(f"{run_dir} holds imported weights (pretrain import), not a run to resume; fine-tune them "
                         f"in a new run: {finetune_command(run_dir)}")


def collator_for(data) -> Collator:
    """The collate function a DataConfig asks for (the tokenizer's EOD id, position and mask options;
    a synthetic task's own collator)."""
    if data.task:
        from pretrain.tasks import TaskCollator

        return TaskCollator()
    eod_id = None
    if data.tokenizer:
        from data_tools.tokenizer import load_tokenizer

        eod_id = load_tokenizer(data.tokenizer).eod_id
    return Collator(eod_id, data.reset_positions, data.mask_cross_document)


@torch.no_grad()
def evaluate_loss(model, dataset, num_samples: int, micro_batch: int, collate, device, autocast=nullcontext) -> dict:
    """Token-weighted mean loss (and diagnostics, as val_<name>) over samples [0, num_samples) of a
    validation dataset; with several data-parallel ranks each takes every n-th micro batch and the
    sums are reduced."""
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
        with autocast():
            loss, diag = model(batch, EVAL)
        if not names and diag:  # loss x tokens, each diagnostic x tokens, tokens
            names = sorted(diag)
            sums = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)
        tokens = batch.loss_mask.sum().double() * weight
        sums += torch.stack([loss.double(), *(diag[n].double() for n in names), torch.ones_like(tokens)]) * tokens
    all_reduce_sum(sums, "validation loss")
    model.train(was_training)
    tokens = max(float(sums[-1]), 1.0)
    val_loss = float(sums[0]) / tokens
    out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": int(sums[-1])}
    out.update({f"val_{n}": float(sums[1 + i]) / tokens for i, n in enumerate(names)})
    return out


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
        self.n_micro = accumulation_steps(t.global_batch_seqs, t.micro_batch_seqs, env.world_size // cfg.parallel.tp,
                                          names=("train.global_batch_seqs", "train.micro_batch_seqs"))
        self.device = resolve_device(t)
        self.amp_dtype = autocast_dtype(t, self.device)
        self.spec = get_arch(cfg.model.arch)
        self.run_dir = t.run_dir
        check_vocab(cfg.data.train + cfg.data.valid, cfg.model.vocab_size)

        def build():
            torch.manual_seed(t.seed)
            return self.spec.build(cfg.model).to(self.device)

        # layout, recompute, compile, engine: in that order, in one place (parallel/apply.py)
        self.engine = parallelize(build, EngineSettings.from_run(cfg), lambda m: build_optimizer(m, cfg.optim),
                                  self.spec.recompute_policies().get(cfg.parallel.recompute), compile=t.compile)
        self.model, self.layout = self.engine.model, layout()
        self.dp_rank, self.dp_size = dp_rank_and_size()
        self.step, self.consumed = 0, 0
        self.collate = collator_for(cfg.data)
        self.train_data = train_dataset(cfg.data)
        self.valid_data, self.valid_samples = valid_dataset(cfg.data)
        self.flops_per_token = self.spec.flops_per_token(cfg.model, cfg.data.seq_len, None)  # expected; per step in the loop
        self.peak_tflops, self.peak_source = device_peak_tflops(self.device, cfg.log.peak_tflops)

    # -- setup ---------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        if self.rank != 0:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(self.cfg))
        if self.cfg.data.tokenizer:  # a run directory must be usable without the original data tree
            dest = os.path.join(self.run_dir, "tokenizer", os.path.basename(self.cfg.data.tokenizer))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not (os.path.exists(dest) and os.path.samefile(dest, self.cfg.data.tokenizer)):  # resumed on its copy
                shutil.copy2(self.cfg.data.tokenizer, dest)

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
        self.log(f"resumed from {path}: step {self.step}, {self.consumed:,} samples consumed" +
                 (f" (checkpoint.init_from {c.init_from} is not read: the run has its own checkpoint)"
                  if c.init_from else ""))

    def _loader(self):
        t, data = self.cfg.train, self.cfg.data
        sampler = GlobalBatchSampler(t.global_batch_seqs, t.micro_batch_seqs, self.dp_rank, self.dp_size,
                                     consumed_samples=self.consumed)
        kwargs = dict(num_workers=data.num_workers, pin_memory=self.device.type == "cuda")
        if data.num_workers:
            kwargs.update(prefetch_factor=4, persistent_workers=True)
        return iter(torch.utils.data.DataLoader(self.train_data, batch_sampler=sampler,
                                                collate_fn=self.collate, **kwargs))

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def save(self) -> str:
        meta = {"consumed_samples": self.consumed, "config": self.cfg.to_dict(),
                "tokenizer": os.path.basename(self.cfg.data.tokenizer) if self.cfg.data.tokenizer else None}
        c = self.cfg.checkpoint
        return save_checkpoint(self.run_dir, self.step, self.engine, None, meta, c.keep_last, c.keep_every,
                               checksums=c.verify)

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        t = self.cfg.train
        n = min(t.eval_batches * t.micro_batch_seqs, self.valid_samples)
        out = evaluate_loss(self.model, self.valid_data, n, t.micro_batch_seqs, self.collate, self.device,
                            self._autocast)
        if self.cfg.data.task:  # a synthetic task also reports its accuracy per group (val_acc_<group>)
            from pretrain.tasks import evaluate_accuracy

            out.update(evaluate_accuracy(self.model, self.spec.logits, self.valid_data, n, t.micro_batch_seqs,
                                         self.device, self._autocast))
        return out

    # -- the loop --------------------------------------------------------------------------------
    def _train_step(self, batches, n_micro: int, window: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step's forward/backward over its micro batches; returns (loss, grad norm).

        Each micro batch's mean loss is weighted by its share of the global batch's target tokens
        (times dp_size, which the engine's gradient averaging divides out), so the gradient is that
        of the token-weighted mean over the global batch whatever the micro batch or rank count.
        The model's diagnostics get the same weights (without the gradient), summed into `window`.
        """
        t0 = time.perf_counter()
        ctx = StepContext.for_step(self.cfg.train.seed, self.step)
        micro = [next(batches).to(self.device, non_blocking=True) for _ in range(n_micro)]
        tokens = torch.stack([b.loss_mask.sum() for b in micro]).float()
        total = all_reduce_sum(tokens.sum(), "target token count").clamp(min=1.0)
        weights = tokens * (self.dp_size / total)
        window["data"] += time.perf_counter() - t0
        loss_sum, diagnostics, t_fwd, t_bwd = self.engine.forward_backward(micro, weights, ctx, self._autocast)
        step_loss = loss_sum / self.dp_size
        for name, value in diagnostics.items():
            share = value / self.dp_size
            window["diagnostics"][name] = window["diagnostics"].get(name, 0.0) + share
        window["forward"] += t_fwd
        window["backward"] += t_bwd
        window["flops"] += self.spec.flops_per_token(self.cfg.model, self.cfg.data.seq_len, ctx) * \
            self.cfg.tokens_per_step
        return step_loss, self.engine.finish_grads(self.cfg.optim.grad_clip)

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self._resume()
        if self.step >= t.max_steps:
            self.log(f"{self.run_dir} is already complete at step {self.step} (train.max_steps={t.max_steps}); "
                     "raise train.max_steps to train further")
            return {"step": self.step}
        self._prepare_run_dir()
        self._describe()
        lead = self.rank == 0
        metrics = MetricsLog(self.run_dir, resume_step=self.step) if lead else None
        wandb = WandbLogger(self.run_dir, cfg.log.wandb_project, t.name, cfg.to_dict()) if cfg.log.wandb and lead else None
        batches = self._loader()
        n_micro = self.n_micro
        last_saved = self.step
        window = self._new_window()
        record: dict = {}
        self.model.train()
        stop = StopOnSignal(t.stop_signals)
        reported_kernels = False
        reset_paths_used()
        try:
            stop.install()
            while self.step < t.max_steps:
                lr = lr_at(self.step, t.max_steps, cfg.optim, cfg.schedule)
                self.engine.set_lr(lr)
                step_loss, grad_norm = self._train_step(batches, n_micro, window)
                t3 = time.perf_counter()
                # The reduced gradients' norm is the same on every rank, so all ranks agree on a skip;
                # the check is a sync, free on CPU, and NaNs must not reach the weights. Without a norm
                # before the step, the loss summed over ranks stands in for it.
                health = grad_norm if grad_norm is not None else all_reduce_sum(step_loss.clone(), "loss check")
                if not torch.isfinite(health):
                    if t.nan_policy == "stop":
                        raise NonFiniteLossError(
                            f"non-finite loss {step_loss.item()} at step {self.step + 1} (lr {lr:.3e}, grad norm "
                            f"{health.item():.3e}); the last checkpoint is intact. Lower optim.lr, check "
                            "the data, or set train.nan_policy=skip")
                    self.log(f"step {self.step + 1}: non-finite loss, step skipped (train.nan_policy=skip)")
                    grad_norm = health
                else:
                    self.engine.step()
                    if grad_norm is None:
                        grad_norm = self.engine.grad_norm_after_step()
                self.engine.zero_grad()
                window["optimizer"] += time.perf_counter() - t3
                self.step += 1
                self.consumed += t.global_batch_seqs
                window["loss"] += step_loss
                window["steps"] += 1

                last = self.step == t.max_steps
                do_eval = last or (t.eval_every and self.step % t.eval_every == 0)
                if do_eval or self.step % t.log_every == 0:
                    record = self._record(window, lr, grad_norm, cfg.tokens_per_step)
                    if do_eval:
                        record.update(self.evaluate())
                    if lead:
                        metrics.write(record)
                        if wandb is not None:
                            wandb.log(record)
                    if not reported_kernels:  # after the first logged step, once: which kernel paths ran
                        reported_kernels = True
                        self.log("kernels: " + (", ".join(f"{op} {'+'.join(p)}" for op, p in paths_used().items())
                                                or "none dispatched"))
                    self.log(progress_line(record, t.max_steps, self.spec.progress) + (
                        f" | val {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})" if do_eval else "")
                        + (f" | {accuracy_line(record)}" if do_eval and cfg.data.task else ""))
                    window = self._new_window()
                if last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                    self.save()
                    last_saved = self.step
                if not last and stop.agreed(self.world_size > 1):
                    if self.step > last_saved:
                        self.save()
                    raise StopRequested(self.step, stop.signame, stop.seconds_since_signal(), cfg.checkpoint.grace_s)
        except KeyboardInterrupt:
            if self.step > last_saved:
                self.log(f"interrupted: saving step {self.step} before exiting")
                self.save()
            raise
        finally:
            stop.restore()
            if metrics is not None:
                metrics.close()
            if wandb is not None:
                wandb.close()
        return record

    def _new_window(self) -> dict:
        return dict(loss=torch.zeros((), device=self.device), diagnostics={}, steps=0, flops=0.0, data=0.0,
                    forward=0.0, backward=0.0, optimizer=0.0, t0=time.perf_counter())

    def _record(self, w: dict, lr: float, grad_norm, tokens_per_step: int) -> dict:
        names = sorted(w["diagnostics"])  # the loss and every diagnostic summed over ranks at once
        sums = all_reduce_sum(torch.stack([w["loss"], *(w["diagnostics"][n] for n in names)]), "logged loss")
        elapsed = max(time.perf_counter() - w["t0"], 1e-9)
        steps = max(w["steps"], 1)
        tokens_per_s = steps * tokens_per_step / elapsed
        tflops = w["flops"] / elapsed / 1e12
        devices = self.layout.world
        parts = {k: w[k] for k in ("data", "forward", "backward", "optimizer")}
        busy = max(sum(parts.values()), 1e-9)
        values = sums.tolist()
        return {
            "step": self.step, "loss": values[0] / steps, "lr": lr, "grad_norm": float(grad_norm),
            **{n: v / steps for n, v in zip(names, values[1:])},
            "tokens_per_s": tokens_per_s, "tflops": tflops,  # the whole job's
            "tokens_per_s_per_device": tokens_per_s / devices, "tflops_per_device": tflops / devices,
            "mfu": tflops / devices / self.peak_tflops if self.peak_tflops else 0.0,  # the peak is per device
            "memory_gb": memory_gb(self.device), "time_split": {k: v / busy for k, v in parts.items()},
            "eta_s": (self.cfg.train.max_steps - self.step) * elapsed / steps,
            "consumed_samples": self.consumed, "tokens": self.consumed * self.cfg.data.seq_len,
        }

    def _describe(self) -> None:
        cfg = self.cfg
        counts = count_parameters(self.model)
        self.log(to_yaml(cfg).rstrip())
        self.log(
            f"model {cfg.model.arch}: {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding); "
            f"{self.flops_per_token / 1e6:,.1f} MFLOP/token | batch {cfg.train.global_batch_seqs} sequences = "
            f"{cfg.tokens_per_step:,} tokens/step | {self.device}, "
            f"{'fp32' if self.amp_dtype is None else 'bf16 autocast'}, {torch.get_num_threads()} threads | "
            f"peak {self.peak_tflops:.3f} TFLOP/s ({self.peak_source}) | {allocator_note()} | run dir {self.run_dir}"
        )
        p, lay = cfg.parallel, self.layout
        self.log(f"layout: {lay.world} rank(s) = tp {lay.tp}{' (+sp)' if lay.sp else ''} x dp {lay.dp} | "
                 f"{self.engine.describe()}{' | megatron-core layers' if lay.megatron_layers else ''}"
                 f"{' | activation recompute: ' + p.recompute if p.recompute != 'none' else ''}")
