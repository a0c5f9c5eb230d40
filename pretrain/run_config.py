"""The typed run configuration: one dataclass per concern, each with a validate() that refuses an
impossible setting in one sentence naming the field, and the typed schema OmegaConf merges a file
or a stored config and the dotted overrides onto.

The schema's model section is the config class of the architecture the run names (`model.arch`, from
the registry) and data.task_params that of its synthetic task: both are chosen in one place,
`typed_schema`. Loading files and run directories, and checking checkpoint.init_from's weights (which
reads another run's stored config through this module), is pretrain/config.py's.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from pretrain.optim import OptimConfig, ScheduleConfig


class ConfigError(ValueError):
    """A configuration problem, in one sentence that names the field."""


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size (megatron-core layers); the world is tp x data-parallel ranks
    pp: int = 1  # pipeline-parallel size
    # pipeline stages per rank: > 1 cuts the model into pp x virtual_stages stages, rank r holding stages
    # r, r + pp, ... (megatron-core's interleaved 1F1B: a bubble v times smaller, v times the messages)
    virtual_stages: int = 1
    sp: bool = False  # sequence parallelism inside the TP group (needs tp > 1)
    data_parallel: str = "ddp"  # engine over data-parallel ranks: ddp (torch) | megatron | deepspeed
    zero_stage: int = 0  # DeepSpeed ZeRO stage 1, 2 or 3 (with data_parallel=deepspeed; 0 otherwise)
    distributed_optimizer: bool = False  # megatron-core's sharded optimizer (with data_parallel=megatron)
    megatron_layers: bool = False  # use megatron-core's layers even at tp=1 (testing, overhead benchmark)
    # activation checkpointing: none | full (the architecture's recommended policy) | a policy it names
    # (`pretrain info` lists them; CRT: block, pass)
    recompute: str = "none"
    timeout_s: float = 600.0  # collective timeout: a stuck rank is reported after this long

    def validate(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"parallel.tp must be >= 1, got {self.tp}")
        if self.pp < 1:
            raise ConfigError(f"parallel.pp must be >= 1, got {self.pp}")
        if self.virtual_stages < 1:
            raise ConfigError(f"parallel.virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ConfigError(f"parallel.virtual_stages={self.virtual_stages} interleaves pipeline stages: it needs "
                              "parallel.pp > 1")
        if self.pp > 1 and self.data_parallel == "deepspeed":
            raise ConfigError(f"parallel.pp={self.pp} with parallel.data_parallel=deepspeed is not supported: "
                              "ZeRO reduces gradients inside DeepSpeed's own backward, which the pipeline schedule "
                              "bypasses; use parallel.data_parallel=megatron with parallel.distributed_optimizer=true "
                              "for a sharded optimizer state")
        if self.sp and self.tp == 1:
            raise ConfigError("parallel.sp=true splits the sequence over the tensor-parallel group: it needs "
                              "parallel.tp > 1")
        engines = ("ddp", "megatron", "deepspeed")
        if self.data_parallel not in engines:
            raise ConfigError(f"parallel.data_parallel must be one of {', '.join(engines)}, got {self.data_parallel!r}")
        if self.data_parallel == "deepspeed":
            if self.zero_stage not in (1, 2, 3):
                raise ConfigError(f"parallel.zero_stage must be 1, 2 or 3 with parallel.data_parallel=deepspeed, "
                                  f"got {self.zero_stage}")
            if self.tp > 1 or self.megatron_layers:
                raise ConfigError(f"parallel.data_parallel=deepspeed (ZeRO-{self.zero_stage}) with megatron-core "
                                  "tensor parallelism is not supported (not shown to work); use "
                                  "parallel.data_parallel=megatron with parallel.distributed_optimizer=true")
        elif self.zero_stage != 0:
            raise ConfigError(f"parallel.zero_stage={self.zero_stage} needs parallel.data_parallel=deepspeed "
                              f"(got {self.data_parallel!r})")
        if self.distributed_optimizer and self.data_parallel != "megatron":
            raise ConfigError("parallel.distributed_optimizer=true is megatron-core's: it needs "
                              "parallel.data_parallel=megatron")
        if not self.recompute.isidentifier():
            raise ConfigError(f"parallel.recompute must be none, full or a policy the architecture names, got "
                              f"{self.recompute!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be positive, got {self.timeout_s}")


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)  # .bin/.idx prefixes; several make a blend
    train_weights: list[float] = field(default_factory=list)  # blend weights; empty = by token count
    valid: list[str] = field(default_factory=list)  # validation prefixes; empty = a split of `train`
    split: str = ""  # train,valid,test shares of `train`; "" = "949,50,1", or "1,0,0" with `valid`
    seq_len: int = 256  # tokens per training sequence
    seed: int = 1234  # data order seed (sample order is a pure function of it and the data config)
    tokenizer: str = ""  # sentencepiece .model or tokenizer.json; copied into the run directory
    reset_positions: bool = False  # RoPE positions restart at each document of a packed sample
    mask_cross_document: bool = True  # no loss on targets that start a new document
    num_workers: int = 1  # DataLoader worker processes (0 = in the training process)
    cache_dir: str = ""  # index cache; "" = beside each dataset
    # A synthetic task (pretrain/tasks) generated from data.seed instead of the files above; "" = files.
    task: str = ""
    task_params: Any = None  # the task's typed parameters (its registry config class), with data.task

    def resolved_split(self) -> str:
        return self.split or ("1,0,0" if self.valid else "949,50,1")

    def validate(self) -> None:
        if self.task:
            for name in ("train", "valid", "tokenizer"):
                if getattr(self, name):
                    raise ConfigError(f"data.{name} must be empty with data.task={self.task} (the task generates "
                                      "its own tokens); set data.task='' to train on files")
        elif not self.train:
            raise ConfigError("data.train is empty; give one or more .bin/.idx prefixes "
                              "(make them with `pretrain-data preprocess`), or a synthetic data.task")
        if self.train_weights and len(self.train_weights) != len(self.train):
            raise ConfigError(f"data.train_weights has {len(self.train_weights)} entries for "
                              f"{len(self.train)} data.train prefixes")
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be positive, got {self.seq_len}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")
        self.check_files()

    def validate_task(self, vocab_size: int) -> None:
        """data.task and data.task_params agree, and the run fits the task (seq_len, model.vocab_size)."""
        if not self.task:
            if self.task_params is not None:
                raise ConfigError("data.task_params is set but data.task is empty; name the task (e.g. "
                                  "data.task=pointer_chasing) or remove data.task_params")
            return
        from pretrain.tasks import check_run

        try:
            check_run(self.task, self.task_params, self.seq_len, vocab_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def check_files(self, fields: tuple = ("train", "valid", "tokenizer")) -> None:
        """The datasets and tokenizer named by `fields` exist ("eval": those evaluation reads); else
        one sentence naming the path and the field to override."""
        if "eval" in fields:
            fields = (*fields, *self.eval_fields())
            if not (self.valid or self.train or self.task):  # e.g. a run made by `pretrain import`
                raise ConfigError("no validation data: this run names no datasets; give them with the override "
                                  "data.valid=[PREFIX]")
        for name in ("train", "valid"):
            for prefix in getattr(self, name) if name in fields else ():
                if not (os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")):
                    raise ConfigError(f"data.{name}: dataset {prefix!r} not found (expected {prefix}.bin and "
                                      f"{prefix}.idx); give its location with the override data.{name}=[PREFIX]")
        if "tokenizer" in fields and self.tokenizer and not os.path.isfile(self.tokenizer):
            raise ConfigError(f"data.tokenizer {self.tokenizer!r} does not exist; give its location with the "
                              "override data.tokenizer=PATH")

    def eval_fields(self) -> tuple:
        """The fields evaluation reads: the validation datasets (data.valid, else a split of data.train)."""
        return ("valid", "tokenizer") if self.valid else ("train", "tokenizer")


@dataclass
class TrainConfig:
    name: str = "run"
    run_dir: str = "runs/${train.name}"  # checkpoints, resolved config, metrics.jsonl
    max_steps: int = 1000  # optimizer steps
    global_batch_seqs: int = 8  # sequences per optimizer step (x data.seq_len tokens)
    micro_batch_seqs: int = 8  # sequences per forward/backward; the rest is gradient accumulation
    seed: int = 0  # initialisation and dropout seed
    # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp64 (float64 weights and math, one process without
    # TP, PP or ZeRO: for numerical checks, whose figures then agree across CPUs to ~1e-14)
    precision: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = True  # torch.compile the model (pays off after ~50 steps on CPU; short runs turn it off)
    # model: one graph of the whole forward | blocks: each block compiled on its own (torchtitan's per-block
    # compile; identical blocks share one compiled graph, so it compiles in about one block's time) and the
    # read-out (final norm, head, loss) apart; CRT and GPN compile their own pieces either way
    compile_scope: str = "model"
    # CUDA graphs for the loops an architecture declares (RT's layers, GPN's segments; kernels/captured.py):
    # auto (captured on a GPU, eager elsewhere with one line saying so) | on (refused where it cannot) | off
    cuda_graphs: str = "off"
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    log_every: int = 10  # steps between progress lines and metrics.jsonl records
    eval_every: int = 200  # steps between validation passes; 0 = only at the end
    eval_batches: int = 20  # micro batches per validation pass
    nan_policy: str = "stop"  # stop | skip: what a step with a non-finite loss or grad norm does
    max_bad_steps: int = 5  # skipped steps in a row allowed; one more stops the run (0: stop at the first skip)
    # skip a step whose loss or grad norm is more than z std above its mean over the last
    # skip_outlier_window good steps (OLMo-core's rule; active once the window is full); null = off
    skip_outlier_z: Optional[float] = None
    skip_outlier_window: int = 100
    stop_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # finish the step, checkpoint, exit 75

    def validate(self) -> None:
        for name in ("max_steps", "global_batch_seqs", "micro_batch_seqs", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        from parallel.data_parallel import accumulation_steps

        try:
            accumulation_steps(self.global_batch_seqs, self.micro_batch_seqs,
                               names=("train.global_batch_seqs", "train.micro_batch_seqs"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every}")
        if self.max_bad_steps < 0:
            raise ConfigError(f"train.max_bad_steps must be >= 0 (skipped steps in a row before the run stops), "
                              f"got {self.max_bad_steps}")
        z = self.skip_outlier_z
        if z is not None and not z > 0:  # NaN fails the comparison too
            raise ConfigError(f"train.skip_outlier_z must be > 0 (the z threshold of the outlier rule), or null to turn "
                              f"it off, got {z}")
        if self.skip_outlier_window < 2:
            raise ConfigError(f"train.skip_outlier_window must be at least 2 steps, got {self.skip_outlier_window}")
        if str(self.cuda_graphs) in ("True", "False"):  # YAML 1.1 reads a bare on / off as a boolean
            self.cuda_graphs = "on" if str(self.cuda_graphs) == "True" else "off"
        choices = {"precision": ("auto", "fp32", "bf16", "fp64"), "device": ("auto", "cpu", "cuda"),
                   "nan_policy": ("stop", "skip"), "cuda_graphs": ("auto", "on", "off"),
                   "compile_scope": ("model", "blocks")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"train.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        from pretrain.preemption import signal_numbers

        try:
            signal_numbers(list(self.stop_signals))
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # newest checkpoints kept
    keep_every: int = 0  # also keep every step that is a multiple of this (milestones); 0 = none
    resume: bool = True  # continue from the run directory's latest checkpoint when there is one
    grace_s: float = 60.0  # a stop signal's checkpoint must be written within this (launchers wait longer)
    verify: bool = True  # record checksums at save, verify them at load (false: skip both, for very large runs)
    # The run directory's lock (pretrain/runlock.py): its holder refreshes it every lock_timeout_s / 4;
    # a lock whose heartbeat is older than this is taken over.
    lock_timeout_s: float = 120.0
    # A run directory (its latest verified checkpoint) or a checkpoint directory whose model weights a
    # run without a checkpoint of its own starts from (fresh optimizer, step 0); another model.arch is
    # converted by this one's registry `convert`. "" = none. (pretrain/init_from.py)
    init_from: str = ""

    def validate(self) -> None:
        if not 0 < self.grace_s < 86400:
            raise ConfigError(f"checkpoint.grace_s must be between 0 and 86400 seconds, got {self.grace_s}")
        if self.every < 0 or self.keep_every < 0:
            raise ConfigError("checkpoint.every and checkpoint.keep_every must be >= 0")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be at least 1, got {self.keep_last}")
        if not 0 < self.lock_timeout_s < float("inf"):
            raise ConfigError(f"checkpoint.lock_timeout_s must be a positive number of seconds, got {self.lock_timeout_s}")


@dataclass
class LogConfig:
    wandb: bool = False  # log to Weights & Biases (offline mode unless WANDB_MODE says otherwise)
    wandb_project: str = "recurrent-pretrain"
    peak_tflops: float = 0.0  # device peak for MFU; 0 = probe (CPU) or the table of known GPUs
    # print the whole resolved config at the start (it is always written to the run directory's
    # config.yaml); off: a summary of a few lines
    show_config: bool = False

    def validate(self) -> None:
        if self.peak_tflops < 0:
            raise ConfigError(f"log.peak_tflops must be >= 0, got {self.peak_tflops}")


@dataclass
class RunConfig:
    model: Any = None  # the architecture's config: a pretrain.models.base.ModelConfig subclass
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self, check_data: bool = True) -> "RunConfig":
        """Refuse an impossible setting in one sentence naming the field; `check_data` also checks the
        files training reads (the datasets, the tokenizer). The weights of checkpoint.init_from are
        checked by pretrain.config, which loads configs: they are another run's, read through this one."""
        from pretrain.models import get_arch

        self.model.validate()
        spec = get_arch(self.model.arch)
        # The architecture's support matrix (its registry entry), before any process group exists and
        # before the generic layout checks, so an architecture's own reason is the one given.
        refuse = spec.supports.refusal(self.parallel)
        if refuse:
            raise ConfigError(f"model.arch {spec.name!r}: {refuse}")
        self.parallel.validate()
        policies = spec.recompute_policies()
        if self.parallel.recompute != "none" and self.parallel.recompute not in policies:
            offered = f"offers {', '.join(policies)}" if policies else "names no recompute policy in its registry entry"
            raise ConfigError(f"parallel.recompute={self.parallel.recompute}: model.arch {spec.name!r} {offered}")
        if self.parallel.pp > 1:
            try:
                spec.pipeline_split(self.model, self.parallel.pp * self.parallel.virtual_stages)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self.train.compile:
                raise ConfigError(f"train.compile=true with parallel.pp={self.parallel.pp} is not supported yet "
                                  "(the stages run outside the compiled forward); set train.compile=false")
            if self.data.task:
                raise ConfigError(f"data.task={self.data.task} with parallel.pp={self.parallel.pp} is not supported "
                                  "(a task's accuracy reads logits, which only the last stage has)")
        for name, size in spec.tp_dims(self.model).items():
            if size % self.parallel.tp:
                raise ConfigError(f"parallel.tp={self.parallel.tp} does not divide {name} = {size}")
        par = self.parallel
        if getattr(self.model, "loss_chunk", 0) and (par.tp > 1 or par.megatron_layers):
            raise ConfigError(f"model.loss_chunk={self.model.loss_chunk} is not used under megatron-core's layers "
                              f"(parallel.tp={par.tp}, parallel.megatron_layers={str(par.megatron_layers).lower()}): "
                              "their vocab-parallel loss takes the whole logits, split over tp; set model.loss_chunk=0")
        if self.train.precision == "fp64" and (par.tp > 1 or par.pp > 1 or par.data_parallel != "ddp"):
            raise ConfigError(f"train.precision=fp64 runs with parallel.data_parallel=ddp, tp=1 and pp=1 only (got "
                              f"data_parallel={par.data_parallel}, tp={par.tp}, pp={par.pp}): it is a numerical-check mode")
        if self.train.compile and self.parallel.data_parallel != "ddp":
            raise ConfigError(f"train.compile=true is supported with parallel.data_parallel=ddp only; set "
                              f"train.compile=false for {self.parallel.data_parallel}")
        self.data.validate_task(self.model.vocab_size)
        if check_data:
            self.data.validate()
        self.optim.validate()
        self.schedule.validate(self.train.max_steps, self.tokens_per_step)
        self.train.validate()
        if self.train.cuda_graphs == "on":  # the device is checked by the trainer (kernels/captured.check)
            from kernels.captured import why_not

            if why := why_not(*spec.captured_regions(self), self.parallel.pp, spec.name):
                raise ConfigError(f"train.cuda_graphs=on captures nothing here: {why}; use auto or off")
        self.checkpoint.validate()
        if self.checkpoint.lock_timeout_s >= self.parallel.timeout_s:  # a Slurm job may wait that long on rank 0
            raise ConfigError(f"checkpoint.lock_timeout_s ({self.checkpoint.lock_timeout_s:g} s) must be shorter than "
                              f"parallel.timeout_s ({self.parallel.timeout_s:g} s): the other ranks wait in a "
                              "collective while rank 0 waits for a stale run directory lock")
        self.log.validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len {self.data.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")
        self.model.validate_run(self)  # the architecture's checks that need the rest of the run
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_seqs * self.data.seq_len


def typed_schema(*layers):
    """The typed OmegaConf schema of a run built from `layers` (OmegaConf nodes or plain dicts, merged
    in this order: a file or a stored config, then the overrides). The last layer that names a
    model.arch chooses the architecture's config class (baseline if none does); the last that sets
    data.task chooses the task's parameters class ("" = files: data.task_params stays untyped and
    must be unset)."""
    from omegaconf import OmegaConf

    from pretrain.models import get_arch

    arch = next((a for a in (_given(x, "model.arch") for x in reversed(layers)) if a), "baseline")
    task = next((t for t in (_given(x, "data.task") for x in reversed(layers)) if t is not None), "")
    data = DataConfig()
    if task:
        from pretrain.tasks import get_task

        try:
            data.task_params = get_task(str(task)).config_cls()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return OmegaConf.structured(RunConfig(model=get_arch(str(arch)).config_cls(), data=data))


def _given(layer, key: str):
    """The value a config layer gives dotted `key`, or None."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(layer):
        return OmegaConf.select(layer, key)
    for part in key.split("."):
        layer = layer.get(part) if isinstance(layer, dict) else None
    return layer


def typed_config(*layers) -> RunConfig:
    """`layers` merged onto their typed schema (not validated); OmegaConf's errors propagate."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(typed_schema(*layers), *layers))


def from_dict(d: dict, check_data: bool = False, overrides: list[str] | tuple = ()) -> RunConfig:
    """A validated RunConfig from `to_dict()` output (as stored in checkpoints), with dotted overrides
    (pretrain.config.config_from_dict also checks checkpoint.init_from's weights with check_data)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = typed_config(d, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        given = f" with overrides {' '.join(overrides)}" if overrides else ""
        raise ConfigError(f"the stored config{given}: {one_line(e)}") from None
    return cfg.validate(check_data=check_data)


def to_yaml(cfg: RunConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def one_line(e: Exception) -> str:
    # OmegaConf messages carry a multi-line "full_key: ... object_type=..." trailer; keep the gist.
    from data_tools.errors import first_line

    msg = first_line(e)
    key = getattr(e, "full_key", None)
    return f"{msg} (at {key})" if key and str(key) not in msg else msg
