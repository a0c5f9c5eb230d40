"""DeepSpeed ZeRO stage 1/2/3 behind the trainer's Engine interface (parallel/engine.py).

    engine = DeepSpeedEngine(model, optimizer, settings)   # settings.parallel.data_parallel == "deepspeed"

The trainer's AdamW (pretrain.optim.build_optimizer, with its weight-decay groups) is handed to
deepspeed.initialize, which flattens and partitions it: ZeRO-1 shards the optimizer state, ZeRO-2
also the reduced gradients, ZeRO-3 also the parameters. fp32 throughout.

Gradient scaling. The trainer already weights each micro batch's loss by its share of the global
batch's tokens times dp, so DeepSpeed must only average over data-parallel ranks (which ZeRO does)
and must not divide by the accumulation steps again: `backward(loss, scale_wrt_gas=False)`. The
accumulation boundary is set explicitly per micro batch (`set_gradient_accumulation_boundary`), so
ZeRO reduces at the last micro batch whatever its internal micro-step counter says, and the one
`step()` per trainer step is a real optimizer step. Clipping and the grad norm happen inside that
step (config `gradient_clipping`), so `finish_grads` returns None and the norm is read afterwards.

Checkpoints. The view (get_state / set_state / templates) hands over exactly what
parallel.state.LocalState gives for the same model in one process: full fp32 tensors keyed by
the model's FQNs, optimizer state {"step", "exp_avg", "exp_avg_sq"} per parameter, and our two
param groups. It goes through DeepSpeed's full-tensor accessors (deepspeed.utils.safe_get_full_* /
safe_set_full_*), which are collectives: every rank walks the parameters in the same order.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from parallel.data_parallel import accumulation_steps
from parallel.dist import detect_env
from parallel.engine import Engine, EngineSettings
from parallel.grads import set_lr, step_on_device
from parallel.mesh import _ensure_process_group, layout

INSTALL_HINT = ("parallel.data_parallel=deepspeed needs DeepSpeed: install it after torch with "
                "`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`")


def _import_deepspeed():
    if not torch.cuda.is_available():  # DeepSpeed would otherwise probe for accelerators and may pick none
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from None
    return deepspeed


def _init_comm(deepspeed, backend: str) -> None:
    """deepspeed.init_distributed over the existing process group, without DeepSpeed's shared-memory all-reduce
    op: on a CPU it is JIT-built (about 45 s of C++ on 2 cores, the first time on each machine) for its
    inference all-reduce, which ZeRO's training collectives never use."""
    import importlib

    ds_comm = importlib.import_module("deepspeed.comm.torch")  # the package's attribute `torch` is torch itself
    build = getattr(ds_comm, "build_shm_op", None)  # absent from a release that drops it: nothing to skip
    if build is not None:
        ds_comm.build_shm_op = lambda: None
    try:
        deepspeed.init_distributed(dist_backend=backend)
    finally:
        if build is not None:
            ds_comm.build_shm_op = build


# Merged into the config's "zero_optimization" (tests set stage3_param_persistence_threshold=0: ZeRO-3
# keeps parameters under 1e5 elements whole by default, i.e. every parameter of a tiny test model).
ZERO_OVERRIDES: dict = {}


def ds_config(settings: EngineSettings, dp: int) -> dict:
    """The DeepSpeed config of an engine's settings: batch sizes, clipping and ZeRO stage, fp32."""
    micro = settings.micro_batch_seqs
    gas = accumulation_steps(settings.global_batch_seqs, micro, dp)
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.parallel.zero_stage, **ZERO_OVERRIDES},
        "zero_allow_untested_optimizer": True,  # our torch AdamW, not one of DeepSpeed's own
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,  # the trainer logs progress
        "wall_clock_breakdown": False,
    }


def _forwardless_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of modules that have no forward of their own (the LM head is used through
    .loss()/.logits()). ZeRO-3 gathers a module's parameters in hooks around its forward, so these
    would stay partitioned (empty) when used; they are registered with the root module instead."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if type(module).forward is nn.Module.forward:
            for p in module.parameters(recurse=False):
                found[id(p)] = p
    return list(found.values())


class DeepSpeedEngine(Engine):
    """ZeRO stage settings.parallel.zero_stage over the data-parallel ranks (the whole world, tp = 1)."""

    name = "deepspeed"
    has_optimizer = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, settings: EngineSettings):
        deepspeed = _import_deepspeed()
        lay = layout()
        if lay.tp != 1:
            raise ValueError("parallel.data_parallel=deepspeed runs with parallel.tp=1 only")
        # DeepSpeed's collectives need a process group even for one process, where the trainer makes
        # none: a private one-rank gloo group. With several ranks the trainer's group is reused as is.
        _ensure_process_group(settings.parallel.timeout_s)
        # DeepSpeed insists on LOCAL_RANK, which only torchrun sets, and takes it for the GPU's index: give it
        # the device parallel.dist set (on a CPU the launcher's local rank: srun's, mpirun's, 0 for one process)
        os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available()
                                                else detect_env().local_rank))
        _init_comm(deepspeed, dist.get_backend())  # wraps the existing group
        self.stage = settings.parallel.zero_stage
        self.model, self.optimizer, self.settings = model, optimizer, settings
        # What the checkpoint view needs, captured before DeepSpeed replaces the groups' params
        # with its flat partitions: each group's parameters (named as named_parameters names a tied
        # one, i.e. as torch's state-dict helpers do) and its hyperparameter keys.
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups = [[(names[id(p)], p) for p in g["params"]] for g in self.optimizer.param_groups]
        self.group_keys = [[k for k in g if k != "params"] for g in self.optimizer.param_groups]
        if self.stage == 3:
            for p in _forwardless_params(model):
                deepspeed.zero.register_external_parameter(model, p)
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer,
                                                config=ds_config(settings, max(lay.dp, 1)))
        self.zero = self.ds.optimizer  # the ZeRO wrapper; it steps self.optimizer on its flat partitions
        self.shared_masters = self._share_fp32_masters()

    def _share_fp32_masters(self) -> bool:
        """In fp32 DeepSpeed ZeRO-1/2 keep a "master" copy of this rank's partition of the flat
        parameters that is the same dtype as the parameters themselves; AdamW steps the copy and
        DeepSpeed copies it back every step. Make the master the model's own partition instead: the
        same numbers, 4 bytes per parameter (of the partition) less, and the copy-back becomes a copy
        of a tensor onto itself, which torch skips. DeepSpeed's per-parameter views into the master
        (its hp links, used by the checkpoint view) are then rebuilt.
        Returns whether it applied (not for ZeRO-3, CPU offload, or a DeepSpeed whose internals differ)."""
        z = self.zero
        needed = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group",
                  "_link_all_hp_params")
        if self.stage not in (1, 2) or getattr(z, "cpu_offload", True) or not all(hasattr(z, a) for a in needed):
            return False
        pairs = []
        for i, master in enumerate(z.single_partition_of_fp32_groups):
            own = z.parallel_partitioned_bit16_groups[i][dist.get_rank(group=z.real_dp_process_group[i])]
            if own.dtype != master.dtype or own.shape != master.shape or self.optimizer.state.get(master):
                return False
            pairs.append((master, own))
        for master, own in pairs:
            master.data = own.data
        z._link_all_hp_params()
        return True

    # -- the training step ---------------------------------------------------------------------
    def accumulating(self, last: bool):
        """Tell ZeRO whether this micro batch ends the step: it reduces (ZeRO-1) or finishes its
        bucketed reduce-scatter into the partitioned gradients (ZeRO-2/3) only then."""
        self.ds.set_gradient_accumulation_boundary(last)
        return nullcontext()

    def describe(self) -> str:
        return f"DeepSpeed ZeRO-{self.stage}"

    def forward(self, batch, ctx):
        return self.ds(batch, ctx)

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer's loss weights already make the mean over micro batches; ZeRO averages over ranks.
        self.ds.backward(loss, scale_wrt_gas=False)

    def finish_grads(self, max_norm: float) -> None:
        """Nothing to do: ZeRO reduced at the boundary, and step() clips to the config's
        gradient_clipping (ds_config: optim.grad_clip, the value the trainer passes as max_norm)."""
        return None

    def step(self) -> None:
        self.ds.step()  # at the boundary set above: one optimizer step (clip, AdamW, re-gather)
        self._link_optimizer_state()

    def grad_norm_after_step(self) -> torch.Tensor:
        norm = self.ds.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else float(norm), dtype=torch.float32)

    def zero_grad(self) -> None:
        self.zero.zero_grad(set_to_none=True)
        self.ds.zero_grad()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)  # the torch AdamW that DeepSpeed steps (its groups are ours)

    # -- the checkpoint view -------------------------------------------------------------------
    def _flat_masters(self) -> list[torch.Tensor]:
        """The fp32 partitions the inner AdamW holds state for (one per group, or per ZeRO-3 sub-group)."""
        if self.stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def _full_shape(self, p: torch.Tensor) -> torch.Size:
        return p.ds_shape if hasattr(p, "ds_shape") else p.shape

    def _full_param(self, p: nn.Parameter) -> torch.Tensor:
        full = None
        if p.requires_grad:
            from deepspeed.utils import safe_get_full_fp32_param

            full = safe_get_full_fp32_param(p)
        if full is None:  # a frozen parameter has no fp32 master: read the module's own copy
            with self._gathered(p):
                full = p.detach().clone()
        return full.detach().to("cpu", torch.float32).reshape(self._full_shape(p))

    @contextmanager
    def _gathered(self, p: nn.Parameter, modify: bool = False):
        """p whole for the duration (a collective under ZeRO-3; with `modify`, rank 0's writes are
        broadcast and re-partitioned on exit)."""
        if self.stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=0 if modify else None):
            yield

    def _state_keys(self) -> list[str]:
        """AdamW's per-parameter state entries, as torch names them."""
        amsgrad = any(g.get("amsgrad") for g in self.optimizer.param_groups)
        return ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])

    def _param_groups(self) -> list[dict]:
        return [{**{k: g[k] for k in keys}, "params": [n for n, _ in names]}
                for g, keys, names in zip(self.optimizer.param_groups, self.group_keys, self.groups)]

    def get_state(self):
        from deepspeed.utils import safe_get_full_optimizer_state

        model_sd, done = {}, {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter):
                if id(value) not in done:  # a tied weight is gathered once and saved under each name
                    done[id(value)] = self._full_param(value)
                model_sd[key] = done[id(value)]
            else:
                model_sd[key] = value.detach().clone()
        state = {}
        inner = self.optimizer.state
        masters = [m for m in self._flat_masters() if m in inner and inner[m]]
        if masters:  # nothing before the first step, like a fresh torch AdamW
            scalars = {k: v.detach().clone() for k, v in inner[masters[0]].items() if v.dim() == 0}
            for names in self.groups:
                for name, p in names:
                    entry = {k: v.clone() for k, v in scalars.items()}
                    for key in self._state_keys():
                        if key not in scalars:
                            full = safe_get_full_optimizer_state(p, key)
                            entry[key] = full.detach().to("cpu", torch.float32).reshape(self._full_shape(p))
                    state[name] = entry
        return model_sd, {"state": state, "param_groups": self._param_groups()}

    def model_template(self) -> dict:
        return {k: torch.empty(self._full_shape(v), dtype=v.dtype)
                for k, v in self.model.state_dict(keep_vars=True).items()}

    def optim_template(self) -> dict:
        return {name: {k: torch.zeros((), dtype=torch.float32) if k == "step"
                       else torch.empty(self._full_shape(p), dtype=torch.float32) for k in self._state_keys()}
                for names in self.groups for name, p in names}

    def _set_full(self, p: nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
        """Scatter a full fp32 tensor into this rank's partition of p's master (`key` None) or of that
        optimizer state.

        ZeRO-3 pads a parameter to partition size x ranks, but DeepSpeed's set_full_hp_param (0.19)
        narrows the unpadded value at rank x partition size: past its end on a rank whose partition
        is all or partly padding (CART's 3-element `hyper` over 2 ranks). So this rank's slice is cut
        here, zero-padded as ZeRO pads, and handed to the per-partition setter. A DeepSpeed without
        those internals gets the full-tensor call."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        z = getattr(p, "_z3_optimizer", None)
        if (hasattr(p, "ds_id") and hasattr(p, "partition_numel") and hasattr(z, "set_local_hp_param")
                and hasattr(z, "_get_param_partition_rank")):
            n = p.partition_numel()
            start = n * z._get_param_partition_rank(p)
            mine = value.reshape(-1)[start:start + n]  # shorter (or empty) where the padding begins
            z.set_local_hp_param(torch.cat([mine, mine.new_zeros(n - mine.numel())]), p, key)
        elif key is None:
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)

    def set_state(self, model_sd: dict, optim_state: dict, groups: list | None) -> None:
        params = dict(self.model.named_parameters())
        for key, value in self.model.state_dict(keep_vars=True).items():
            if not isinstance(value, nn.Parameter):
                value.data.copy_(model_sd[key])
        for name, p in params.items():
            full = model_sd[name].to(torch.float32)
            if p.requires_grad:
                self._set_full(p, full)  # the fp32 master the optimizer steps
            with self._gathered(p, modify=True):  # and the module's copy the forward uses
                p.data.copy_(full.reshape(p.shape).to(p.dtype))
        if groups is None:
            return
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the checkpoint has {len(groups)} optimizer param groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        inner = self.optimizer.state
        masters = self._flat_masters()
        if not optim_state:
            for m in masters:
                inner.pop(m, None)
            return
        # A fresh AdamW creates its state lazily at its first step; create it now so that the full
        # tensors can be scattered into the partitions (AdamW keeps state it finds).
        first, on_device = next(iter(optim_state.values())), step_on_device(self.optimizer.param_groups)
        for m in masters:
            inner[m] = {k: (v.detach().clone().to(m.device if on_device else "cpu") if v.dim() == 0
                            else torch.zeros_like(m)) for k, v in first.items()}
        self._link_optimizer_state()
        for names in self.groups:
            for name, p in names:
                for key, value in optim_state[name].items():
                    if value.dim():
                        self._set_full(p, value.to(torch.float32), key)

    def _link_optimizer_state(self) -> None:
        """Map every parameter to its slice of the (new) optimizer state, for the safe_*_optimizer_state
        accessors. ZeRO-1/2 do it once, right after stepping the first param group, so the slices of
        the other groups' parameters, whose state does not exist yet, stay unmapped; and state
        created by set_state is new. Views only, cheap. (ZeRO-3 looks the state up on each access.)"""
        if self.stage == 3 or not hasattr(self.zero, "_hp_optimizer_states_linked"):
            return
        self.zero._hp_optimizer_states_linked = False
        self.zero._lazy_init_hp_params_optimizer_state()
