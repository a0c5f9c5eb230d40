"""megatron-core's data parallelism as an engine: its DDP (contiguous gradient buckets reduced once per
step) and optionally its distributed optimizer (optimizer state sharded over data-parallel ranks, the
updated parameter shards all-gathered after each step: ZeRO-1 in megatron's terms).

megatron's calls that build CUDA tensors on a CPU machine run inside `cpu_shim.scoped()`; the model's
forward and backward do not. Checkpoints stay layout-free: the view below assembles each parameter's
full Adam state from the ranges every data-parallel rank owns (one all-reduce per save) and takes
back only this rank's ranges on load. Optimizer hyperparameters come from the run's config on load
(the learning rate is set every step anyway); the saved param_groups describe our AdamW grouping so
that the same checkpoint resumes under the torch or DeepSpeed engines.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from parallel import cpu_shim
from parallel.dist import collective
from parallel.engine import Engine, EngineSettings, FullState
from parallel.grads import all_reduce_tp_grads, set_lr, step_on_device
from parallel.layers import sequence_parallel_params
from parallel.mesh import layout

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def named_param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """An optimizer's param_groups with parameters named by FQN (the form checkpoints store)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


def _parts(optimizer) -> list:
    """megatron's optimizer as the list of the ones it chains (one when it chains none)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


class MegatronEngine(Engine):
    name = "megatron"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: EngineSettings):
        """megatron builds its own optimizer over its gradient buffers; it takes the hyperparameters,
        the weight-decay grouping (for checkpoints) and the kernel flags of the trainer's `optimizer`."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        lay, o = layout(), optimizer.defaults
        self.model, self.settings = model, settings
        self.distributed = settings.parallel.distributed_optimizer
        self.groups = named_param_groups(model, optimizer)  # what checkpoints store as param_groups
        self.sp_params = sequence_parallel_params(model)
        # megatron's DDP reads one flag of a TransformerConfig (calculate_per_token_loss); the sizes
        # are placeholders it requires, not our model's.
        tcfg = TransformerConfig(num_layers=1, hidden_size=lay.tp, num_attention_heads=lay.tp,
                                 tensor_model_parallel_size=lay.tp, sequence_parallel=lay.sp,
                                 use_cpu_initialization=True, gradient_accumulation_fusion=False,
                                 params_dtype=torch.float32)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.distributed)
        ocfg = OptimizerConfig(optimizer="adam", lr=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0],
                               adam_beta2=o["betas"][1], adam_eps=o["eps"], clip_grad=settings.grad_clip,
                               use_distributed_optimizer=self.distributed, params_dtype=torch.float32)
        with cpu_shim.scoped():
            self.wrapped = DistributedDataParallel(tcfg, ddp_cfg, model)
            self.optimizer = get_megatron_optimizer(ocfg, [self.wrapped])
        # megatron applies each group's wd_mult (0 for norms and biases) in its lr scheduler, which we
        # do not use (the trainer sets the lr): apply it here, as our AdamW groups do
        for group in self.optimizer.param_groups:
            group["weight_decay"] = o["weight_decay"] * group.get("wd_mult", 1.0)
        # without apex or Transformer Engine megatron builds torch's AdamW with no kernel flags, which on
        # CPU means a per-parameter loop: give it the kernels our own AdamW uses
        flags = {k: o[k] for k in ("fused", "foreach") if k in o}
        for opt in _parts(self.optimizer):
            if isinstance(opt.optimizer, torch.optim.Adam):  # torch's AdamW is an Adam subclass
                for group in opt.optimizer.param_groups:
                    group.update(flags)
        self.forward = self.wrapped
        self.state = FullState(MegatronState(self), model)

    def describe(self) -> str:
        return "megatron-core DDP" + (" + distributed optimizer" if self.distributed else "")

    def accumulating(self, last: bool):
        # overlap_grad_reduce is off: gradients accumulate in megatron's buffers until finish_grads
        return nullcontext()

    def finish_grads(self, max_norm: float) -> torch.Tensor:
        all_reduce_tp_grads([p.main_grad for p in self.sp_params])
        with cpu_shim.scoped():
            self.wrapped.finish_grad_sync()
            self.optimizer.prepare_grads()
            norm = self.optimizer.clip_grad_norm(max_norm) if max_norm > 0 else self.optimizer.get_grad_norm()
        return torch.as_tensor(float(norm), dtype=torch.float32)

    def step(self) -> None:
        with cpu_shim.scoped():
            self.optimizer.step_with_ready_grads()

    def zero_grad(self) -> None:
        self.wrapped.zero_grad_buffer()
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)


class MegatronState:
    """The TP-local checkpoint view of a MegatronEngine (FullState adds the TP gathering)."""

    has_optimizer = True

    def __init__(self, engine: MegatronEngine):
        self.engine, self.model = engine, engine.model
        self.params = dict(engine.model.named_parameters())  # tied weights once, under their first name
        self.groups = engine.groups  # what checkpoints store as param_groups: the trainer's AdamW grouping

    def _owned(self) -> dict[str, tuple[dict, torch.Tensor, int, int]]:
        """name -> (the torch optimizer state holding it, the tensor that state is keyed by, start and
        end of the flattened parameter this rank updates)."""
        out = {}
        for opt in _parts(self.engine.optimizer):
            inner = opt.optimizer.state
            if not self.engine.distributed:
                ids = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
                out.update({n: (inner, p, 0, p.numel()) for n, p in self.params.items() if id(p) in ids})
                continue
            shards = {id(m): s for mg, sg in zip(opt.model_fp32_groups, opt.shard_fp32_groups) for m, s in zip(mg, sg)}
            for n, p in self.params.items():
                if id(p) in shards:
                    r = opt._get_model_param_range_map(p)["param"]
                    out[n] = (inner, shards[id(p)], r.start, r.end)
        return out

    def get_state(self):
        model_sd = self.model.state_dict()
        owned, groups = self._owned(), self.groups
        if not any(key in inner for inner, key, _, _ in owned.values()):
            return model_sd, {"state": {}, "param_groups": groups}
        state = {}
        for n, p in self.params.items():
            entry = {k: torch.zeros(p.numel(), dtype=torch.float32) for k in _ADAM_KEYS}
            step = torch.zeros((), dtype=torch.float32)
            if n in owned and owned[n][1] in owned[n][0]:
                inner, key, start, end = owned[n]
                for k in _ADAM_KEYS:
                    entry[k][start:end] = inner[key][k].reshape(-1)
                # on the host on every rank (a fused AdamW keeps it on the GPU): a rank that owns none of this
                # parameter reduces a host zero, and the collective must take the same backend on every rank
                step = inner[key]["step"].detach().to("cpu", torch.float32, copy=True)
            if self.engine.distributed:  # each rank filled the ranges it owns
                flat = torch.cat([entry[k] for k in _ADAM_KEYS])
                collective("all_reduce(optimizer state)", dist.all_reduce, flat, group=layout().dp_group)
                entry = dict(zip(_ADAM_KEYS, flat.split(p.numel())))
                collective("all_reduce(optimizer step)", dist.all_reduce, step, op=dist.ReduceOp.MAX,
                           group=layout().dp_group)
            state[n] = {"step": step, **{k: v.view_as(p) for k, v in entry.items()}}
        return model_sd, {"state": state, "param_groups": groups}

    def model_template(self) -> dict:
        # megatron's tensor-parallel layers add `_extra_state: None` entries, which hold nothing (the
        # engine's TP view leaves them out; megatron's load hook recreates them)
        return {k: torch.empty_like(v) for k, v in self.model.state_dict().items() if v is not None}

    def optim_template(self) -> dict:
        return {n: {"step": torch.zeros((), dtype=torch.float32),
                    **{k: torch.empty_like(p, dtype=torch.float32) for k in _ADAM_KEYS}} for n, p in self.params.items()}

    def set_state(self, model_sd: dict, optim_state: dict, groups) -> None:
        # in place: under the distributed optimizer megatron's fp32 shards are views of these tensors
        self.model.load_state_dict(model_sd)
        owned = self._owned()
        for inner, _, _, _ in owned.values():
            inner.clear()
        # written in directly (not through load_state_dict, which would place them): the moments on their
        # parameter's device, `step` there too where AdamW keeps it there (step_on_device), else on the host
        device_step = step_on_device(g for o in _parts(self.engine.optimizer) for g in o.optimizer.param_groups)
        for n, (inner, key, start, end) in owned.items():
            if n in optim_state:
                s = optim_state[n]
                inner[key] = {"step": s["step"].to(key.device if device_step else "cpu", torch.float32, copy=True),
                              **{k: s[k].reshape(-1)[start:end].to(key.device, copy=True).view_as(key)
                                 for k in _ADAM_KEYS}}
