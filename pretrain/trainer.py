"""The training loop: one code path for every architecture, single process in this version.

    Trainer(load_config("baseline/tiny")).fit()

Each optimizer step: set the lr from the stateless schedule, run the micro batches of one global
batch (gradient accumulation), clip, step. Every `log_every` steps a progress line and a
metrics.jsonl record; every `eval_every` steps a validation pass; every `checkpoint.every` steps an
atomic checkpoint. The data position is the count of consumed samples, so a resumed run reads
exactly the samples the uninterrupted run would have.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from contextlib import nullcontext

import torch

from pretrain.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from pretrain.config import RunConfig, to_yaml
from pretrain.data import Collator, GlobalBatchSampler
from pretrain.data.build import check_vocab, train_dataset, valid_dataset
from pretrain.metrics import MetricsLog, WandbLogger, device_peak_tflops, memory_gb, progress_line
from pretrain.models import count_parameters, get_arch
from pretrain.optim import build_optimizer, clip_grad_norm, lr_at, set_lr


class NonFiniteLossError(RuntimeError):
    pass


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


def eod_id_of(data) -> int | None:
    if not data.tokenizer:
        return None
    from data_tools.tokenizer import load_tokenizer

    return load_tokenizer(data.tokenizer).eod_id


@torch.no_grad()
def evaluate_loss(model, dataset, num_samples: int, micro_batch: int, collate, device, autocast=nullcontext) -> dict:
    """Token-weighted mean loss over samples [0, num_samples) of a validation dataset."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0.0
    for start in range(0, num_samples, micro_batch):
        batch = collate([dataset[i] for i in range(start, min(num_samples, start + micro_batch))]).to(device)
        with autocast():
            loss, _ = model(batch)
        tokens = float(batch.loss_mask.sum())
        total += float(loss) * tokens
        count += tokens
    model.train(was_training)
    val_loss = total / max(count, 1.0)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": int(count)}


class Trainer:
    def __init__(self, cfg: RunConfig, log=print):
        self.cfg, self.log = cfg, log
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t)
        self.amp_dtype = autocast_dtype(t, self.device)
        self.spec = get_arch(cfg.model.arch)
        self.run_dir = t.run_dir
        check_vocab(cfg.data.train + cfg.data.valid, cfg.model.vocab_size)

        torch.manual_seed(t.seed)
        self.model = self.spec.build(cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.forward = torch.compile(self.model) if t.compile else self.model
        self.step, self.consumed = 0, 0
        self.eod_id = eod_id_of(cfg.data)
        self.collate = Collator(self.eod_id, cfg.data.reset_positions, cfg.data.mask_cross_document)
        self.train_data = train_dataset(cfg.data)
        self.valid_data, self.valid_samples = valid_dataset(cfg.data)
        self.flops_per_token = self.spec.flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_tflops, self.peak_source = device_peak_tflops(self.device, cfg.log.peak_tflops)

    # -- setup ---------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(self.cfg))
        if self.cfg.data.tokenizer:  # a run directory must be usable without the original data tree
            dest = os.path.join(self.run_dir, "tokenizer")
            os.makedirs(dest, exist_ok=True)
            shutil.copy2(self.cfg.data.tokenizer, os.path.join(dest, os.path.basename(self.cfg.data.tokenizer)))

    def _resume(self) -> None:
        path = latest_checkpoint(self.run_dir, log=self.log)
        if path is None:
            return
        if not self.cfg.checkpoint.resume:  # starting over would delete that run's checkpoints
            raise ValueError(f"{self.run_dir} already holds checkpoints ({os.path.basename(path)}) and "
                             "checkpoint.resume=false; choose another train.name or train.run_dir, or delete it")
        meta = load_checkpoint(path, self.model, self.optimizer, restore_rng=True, expect_arch=self.cfg.model.arch)
        self.step, self.consumed = int(meta["step"]), int(meta["consumed_samples"])
        self.log(f"resumed from {path}: step {self.step}, {self.consumed:,} samples consumed")

    def _loader(self):
        t, data = self.cfg.train, self.cfg.data
        sampler = GlobalBatchSampler(t.global_batch_seqs, t.micro_batch_seqs, 0, 1, consumed_samples=self.consumed)
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
        return save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, meta, c.keep_last, c.keep_every)

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        t = self.cfg.train
        n = min(t.eval_batches * t.micro_batch_seqs, self.valid_samples)
        return evaluate_loss(self.model, self.valid_data, n, t.micro_batch_seqs, self.collate, self.device,
                             self._autocast)

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self._resume()
        if self.step >= t.max_steps:
            self.log(f"{self.run_dir} is already complete at step {self.step} (train.max_steps={t.max_steps}); "
                     "raise train.max_steps to train further")
            return {"step": self.step}
        self._prepare_run_dir()
        self._describe()
        metrics = MetricsLog(self.run_dir, resume_step=self.step)
        wandb = WandbLogger(self.run_dir, cfg.log.wandb_project, t.name, cfg.to_dict()) if cfg.log.wandb else None
        batches = self._loader()
        n_micro = t.global_batch_seqs // t.micro_batch_seqs
        tokens_per_step = cfg.tokens_per_step
        last_saved = self.step
        window = dict(loss=torch.zeros((), device=self.device), steps=0, data=0.0, forward=0.0,
                      backward=0.0, optimizer=0.0, t0=time.perf_counter())
        record: dict = {}
        self.model.train()
        try:
            while self.step < t.max_steps:
                lr = lr_at(self.step, t.max_steps, cfg.optim, cfg.schedule)
                set_lr(self.optimizer, lr)
                step_loss = torch.zeros((), device=self.device)
                for _ in range(n_micro):
                    t0 = time.perf_counter()
                    batch = next(batches).to(self.device, non_blocking=True)
                    t1 = time.perf_counter()
                    with self._autocast():
                        loss, _ = self.forward(batch)
                    t2 = time.perf_counter()
                    (loss / n_micro).backward()
                    t3 = time.perf_counter()
                    step_loss += loss.detach() / n_micro
                    window["data"] += t1 - t0
                    window["forward"] += t2 - t1
                    window["backward"] += t3 - t2
                t3 = time.perf_counter()
                grad_norm = clip_grad_norm(self.model.parameters(), cfg.optim.grad_clip)
                if not torch.isfinite(step_loss):  # a sync; free on CPU, and NaNs must not reach the weights
                    if t.nan_policy == "stop":
                        raise NonFiniteLossError(
                            f"non-finite loss {step_loss.item()} at step {self.step + 1} (lr {lr:.3e}, grad norm "
                            f"{grad_norm.item():.3e}); the last checkpoint is intact. Lower optim.lr, check "
                            "the data, or set train.nan_policy=skip")
                    self.log(f"step {self.step + 1}: non-finite loss, step skipped (train.nan_policy=skip)")
                    self.optimizer.zero_grad(set_to_none=True)
                else:
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                window["optimizer"] += time.perf_counter() - t3
                self.step += 1
                self.consumed += t.global_batch_seqs
                window["loss"] += step_loss
                window["steps"] += 1

                last = self.step == t.max_steps
                do_eval = last or (t.eval_every and self.step % t.eval_every == 0)
                if do_eval or last or self.step % t.log_every == 0:
                    record = self._record(window, lr, grad_norm, tokens_per_step)
                    if do_eval:
                        record.update(self.evaluate())
                    metrics.write(record)
                    if wandb is not None:
                        wandb.log(record)
                    self.log(progress_line(record, t.max_steps) + (
                        f" | val {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})" if do_eval else ""))
                    window.update(loss=torch.zeros((), device=self.device), steps=0, data=0.0, forward=0.0,
                                  backward=0.0, optimizer=0.0, t0=time.perf_counter())
                if last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                    self.save()
                    last_saved = self.step
        except KeyboardInterrupt:
            if self.step > last_saved:
                self.log(f"interrupted: saving step {self.step} before exiting")
                self.save()
            raise
        finally:
            metrics.close()
            if wandb is not None:
                wandb.close()
        return record

    def _record(self, w: dict, lr: float, grad_norm, tokens_per_step: int) -> dict:
        elapsed = max(time.perf_counter() - w["t0"], 1e-9)
        steps = max(w["steps"], 1)
        tokens_per_s = steps * tokens_per_step / elapsed
        tflops = tokens_per_s * self.flops_per_token / 1e12
        parts = {k: w[k] for k in ("data", "forward", "backward", "optimizer")}
        busy = max(sum(parts.values()), 1e-9)
        return {
            "step": self.step, "loss": float(w["loss"]) / steps, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else 0.0,
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
            f"peak {self.peak_tflops:.3f} TFLOP/s ({self.peak_source}) | run dir {self.run_dir}"
        )
