"""Pipeline parallelism: a model cut into stages, one per pipeline rank, run by megatron-core's 1F1B
schedule over the pipeline group.

The model says how it cuts (pretrain/models/registry.py's `pipeline_split` over the model's units, and
`pipeline_units`, `run_stage` and `keep_stage` from pretrain/models/units.py's driver); this module
knows nothing of what a unit is:
    chunks = Stage.chunks(boundaries, v)    # this rank's stages: units [lo, hi), first/last each
    model.keep_stage(units, first, last)    # what other ranks run is dropped; names stay single-device
    engine = PipelineEngine(model, optimizer, settings, chunks)
With parallel.virtual_stages = v > 1 the model is cut into pp x v stages and rank r holds stages r,
r + pp, ...: megatron-core's interleaved 1F1B, whose bubble is (pp - 1) / (v M) of the step instead of
(pp - 1) / M, for v times the stage-to-stage messages.

Why megatron-core's schedule: it calls the step function with the data iterator on every stage, so
every stage reads the same micro batch and the step context (masks, positions, CRT/CART draws are
values each stage rebuilds from the batch; only the hidden states travel), and it runs over gloo on
CPU (shapes are exchanged per message: `variable_seq_lengths`, so SPS's doubled sequence or any other
activation shape needs no configuration). The loss of micro batch i is scaled by weights[i] on the
last stage (megatron's per-token mode, which divides by nothing), exactly as the other engines scale it.

After the schedule: data-parallel gradients are averaged (one flat all-reduce per dtype, the stage's
parameters only), a weight tied across the first and last stages (the embedding and the output head)
has its two gradients summed over megatron's embedding group, and the gradient norm is reduced over
the stages (the tied copy counted once), so every rank clips with, and decides a skipped step on, the
same norm. The loss and the diagnostics of every stage are summed over the pipeline group, so that
every rank reports the same figures.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from parallel import cpu_shim
from parallel.data_parallel import accumulation_steps
from parallel.dist import collective
from parallel.engine import Engine, FullState, NoTimer
from parallel.grads import all_reduce_flat, all_reduce_tp_grads, grad_square_sum
from parallel.layers import sequence_parallel_params
from parallel.mesh import layout
from parallel.stages import TIED, Stage, interleaving_accepts
from parallel.state import LocalState

def _schedule_config(pp: int, virtual: int, dtype: torch.dtype):
    """The TransformerConfig megatron-core's schedules read (their p2p and loss handling only)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    interleaved = {"virtual_pipeline_model_parallel_size": virtual, "microbatch_group_size_per_vp_stage": pp} \
        if virtual > 1 else {}
    return TransformerConfig(num_layers=pp * virtual, hidden_size=8, num_attention_heads=1,
                             pipeline_model_parallel_size=pp, pipeline_dtype=dtype, variable_seq_lengths=True,
                             calculate_per_token_loss=True, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False,
                             moe_token_dispatcher_type="alltoall", **interleaved)  # (its variable-length check; no MoE)


class _ScheduleView(nn.Module):
    """What megatron's schedule calls on a model chunk: its config, model type and set_input_tensor;
    `stage` says which of this rank's stages it runs."""

    def __init__(self, config, stage: Stage):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config, self.model_type, self.input, self.stage = config, ModelType.encoder_or_decoder, None, stage

    def set_input_tensor(self, tensors) -> None:
        self.input = tensors[0] if isinstance(tensors, (list, tuple)) else tensors


class PipelineState:
    """A stage's checkpoint view: its tensors under their single-device names (the other stages hold
    the rest), the optimizer's param_groups listing every stage's names (merged on save, this stage's
    kept on load), and a tied copy's optimizer state under the single-device (canonical) name, so a
    checkpoint is the single-device one."""

    def __init__(self, inner, model: nn.Module):
        self.inner, self.has_optimizer = inner, inner.has_optimizer
        self.to_canonical = {n: getattr(p, TIED) for n, p in model.named_parameters()
                             if getattr(p, TIED, None) not in (None, n)}
        self.from_canonical = {c: n for n, c in self.to_canonical.items()}

    def get_state(self):
        model_sd, optim_sd = self.inner.get_state()
        if optim_sd is not None:
            canon = lambda n: self.to_canonical.get(n, n)  # noqa: E731
            stage_groups = [[canon(n) for n in g["params"]] for g in optim_sd["param_groups"]]
            everyone = [None] * layout().pp
            collective("all_gather_object(param_groups)", dist.all_gather_object, everyone, stage_groups,
                       group=layout().pp_group)
            groups = [dict(g, params=list(dict.fromkeys(n for stage in everyone for n in stage[i])))
                      for i, g in enumerate(optim_sd["param_groups"])]
            optim_sd = {"state": {canon(k): v for k, v in optim_sd["state"].items()}, "param_groups": groups}
        return model_sd, optim_sd

    def model_template(self):
        return self.inner.model_template()

    def optim_template(self):
        return {self.to_canonical.get(k, k): v for k, v in self.inner.optim_template().items()}

    def set_state(self, model_sd, optim_state, groups):
        if groups is not None:
            mine = {self.to_canonical.get(n, n) for n in self.inner.model_template()}
            groups = [dict(g, params=[self.from_canonical.get(n, n) for n in g["params"] if n in mine])
                      for g in groups]
        if optim_state:
            optim_state = {self.from_canonical.get(k, k): v for k, v in optim_state.items()}
        self.inner.set_state(model_sd, optim_state, groups)


def _gather_union(keys: set, what: str) -> set:
    everyone = [None] * layout().pp
    collective(f"all_gather_object({what})", dist.all_gather_object, everyone, sorted(keys), group=layout().pp_group)
    return {k for stage in everyone for k in stage}


def _send(t: torch.Tensor, peer: int) -> None:
    """A tensor of any shape (up to 7 dimensions) to `peer`: its shape first, on its device (NCCL needs it)."""
    header = torch.zeros(8, dtype=torch.int64, device=t.device)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(t.shape)
    collective("send(stage output shape)", dist.send, header, peer)
    collective("send(stage output)", dist.send, t.contiguous(), peer)


def _recv(peer: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    collective("recv(stage input shape)", dist.recv, header, peer)
    t = torch.empty(header[1:1 + int(header[0])].tolist(), dtype=dtype, device=device)
    collective("recv(stage input)", dist.recv, t, peer)
    return t


def _check_interleaved(lay, settings, virtual: int, device: torch.device) -> None:
    """What megatron-core's interleaved schedule needs, checked before any work (one sentence each)."""
    micro = accumulation_steps(settings.global_batch_seqs, settings.micro_batch_seqs, lay.dp)
    if not interleaving_accepts(lay.pp, micro):
        raise ValueError(f"parallel.virtual_stages={virtual} needs the micro batches per step and rank "
                         f"(train.global_batch_seqs / (train.micro_batch_seqs x dp) = {micro}) to be a multiple of "
                         f"parallel.pp={lay.pp} and at least 2 x parallel.pp")
    # gloo carries the stages' tensors on a CPU, and beside NCCL (cpu:gloo,cuda:nccl) a CPU model's on a GPU host
    if lay.pp == 2 and ("nccl" not in dist.get_backend(lay.pp_group) or device.type == "cpu"):
        raise ValueError(f"parallel.virtual_stages={virtual} with parallel.pp=2 is refused over gloo (CPU): "
                         "megatron-core's interleaved schedule then batches a send and a receive with the same "
                         "peer, which gloo pairs wrongly; use parallel.pp=4 or more, or NCCL")


class PipelineEngine(Engine):
    """This rank's stage, trained with megatron-core's 1F1B schedule; data parallelism by an
    all-reduce of the stage's gradients after the schedule (parallel.data_parallel=ddp; megatron's
    DDP: MegatronPipelineEngine below)."""

    name = "pipeline"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, settings, chunks: list[Stage]):
        lay = layout()
        self.model, self.optimizer, self.settings, self.chunks = model, optimizer, settings, chunks
        self.wrapped = self.forward = model
        self.sp_params = sequence_parallel_params(model)
        self.tied = [p for p in model.parameters() if getattr(p, TIED, False)]
        config = _schedule_config(lay.pp, len(chunks), next(model.parameters()).dtype)
        self.views = [_ScheduleView(config, c) for c in chunks]
        if len(chunks) > 1:
            _check_interleaved(lay, settings, len(chunks), next(model.parameters()).device)
        self.state = FullState(PipelineState(LocalState(model, optimizer), model), model)
        self._forward_only = PipelineForward(self)

    @property
    def inference_model(self) -> nn.Module:
        return self._forward_only

    def keys_of_every_stage(self, keys: set) -> set:
        """The checkpoint keys all stages ask for (a checkpoint's extras are those none asks for)."""
        return _gather_union(keys, "checkpoint keys of every stage")

    def describe(self) -> str:
        lay = layout()
        units = ", ".join(f"{c.lo}..{c.hi - 1}" for c in self.chunks)
        schedule = "1F1B" if len(self.chunks) == 1 else f"interleaved 1F1B, {len(self.chunks)} stages per rank"
        return f"pipeline rank {lay.pp_rank + 1}/{lay.pp} (units {units}), megatron-core {schedule}{self._data_parallel()}"

    def _data_parallel(self) -> str:
        """The start line's words for how the stage's gradients are reduced over data-parallel ranks."""
        lay = layout()
        return f", gradients averaged over {lay.dp} data-parallel ranks" if lay.dp > 1 else ""

    def run(self, micro_batches: list, weights: torch.Tensor | None, ctx, autocast=nullcontext,
            forward_only: bool = False, timer=NoTimer()):
        """The schedule over the micro batches; returns the sum of weights[i] x loss_i and the weighted
        diagnostics, summed over the stages: the same on every rank. The timer's "forward" is this
        stage's forward steps, its "backward" all else in the schedule (backward, sends, receives)."""
        from megatron.core.pipeline_parallel.schedules import (forward_backward_pipelining_with_interleaving,
                                                               forward_backward_pipelining_without_interleaving)

        model = self.model
        n = len(micro_batches)
        weights = torch.ones(n) if weights is None else weights
        device = next(model.parameters()).device  # the sums are reduced over the stages: NCCL needs device tensors
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        sums: dict[str, torch.Tensor] = {}

        def step(data_iterator, view):
            i, s = next(data_iterator), view.stage
            timer.mark("backward")  # the schedule's work since the last forward step
            with autocast():
                out, diag = model.run_stage(micro_batches[i], ctx, view.input, s.lo, s.hi, s.last)
            for name, value in diag.items():
                share = value.detach().float() * weights[i]
                sums[name] = sums[name] + share if name in sums else share
            timer.mark("forward")
            if not s.last:
                return out.to(view.config.pipeline_dtype), None

            def loss_func(loss):
                nonlocal loss_sum
                loss_sum = loss_sum + loss.detach().float() * weights[i]
                return loss * weights[i], torch.ones((), dtype=torch.int), {}

            return out, loss_func

        with cpu_shim.scoped():  # the schedule makes a device="cuda" tensor (a no-op with a GPU)
            if len(self.views) == 1:
                forward_backward_pipelining_without_interleaving(
                    forward_step_func=step, data_iterator=iter(range(n)), model=self.views[0], num_microbatches=n,
                    seq_length=1, micro_batch_size=1, forward_only=forward_only)
            elif forward_only:  # (evaluation: one micro batch, fewer than the interleaved schedule accepts)
                self._forward_through_chunks(step, n)
            else:
                forward_backward_pipelining_with_interleaving(
                    forward_step_func=step, data_iterator=[iter(range(n)) for _ in self.views], model=self.views,
                    num_microbatches=n, seq_length=1, micro_batch_size=1, forward_only=forward_only)
        return self._reduce_over_stages(loss_sum, sums)

    def _forward_through_chunks(self, step, n: int) -> None:
        """Forward only, one micro batch after the other through the pp x v stages in order (evaluation
        under the interleaved split): the owner of stage k runs it and sends its output to the owner of
        stage k + 1, shape first."""
        lay, device = layout(), next(self.model.parameters()).device
        peers = [dist.get_global_rank(lay.pp_group, r) for r in range(lay.pp)]
        for i in range(n):
            for k in range(lay.pp * len(self.views)):
                if k % lay.pp != lay.pp_rank:
                    continue
                view = self.views[k // lay.pp]
                view.input = None if view.stage.first else \
                    _recv(peers[(k - 1) % lay.pp], view.config.pipeline_dtype, device)
                out, loss_func = step(iter([i]), view)
                if loss_func is not None:  # the last stage: the loss is counted as the schedule counts it
                    loss_func(out)
                else:
                    _send(out.detach(), peers[(k + 1) % lay.pp])

    def _reduce_over_stages(self, loss_sum: torch.Tensor, sums: dict) -> tuple[torch.Tensor, dict]:
        """The loss (last stage) and each stage's diagnostics, summed over the pipeline group."""
        lay = layout()
        names = [None] * lay.pp
        collective("all_gather_object(diagnostic names)", dist.all_gather_object, names, sorted(sums),
                   group=lay.pp_group)
        every = sorted({n for stage in names for n in stage})
        flat = torch.stack([loss_sum, *(sums.get(n, loss_sum.new_zeros(())).to(loss_sum.device) for n in every)]).float()
        collective("all_reduce(loss and diagnostics over stages)", dist.all_reduce, flat, group=lay.pp_group)
        return flat[0], {n: flat[1 + k] for k, n in enumerate(every)}

    # the training step (parallel/engine.py's contract)
    def forward_backward(self, micro_batches: list, weights: torch.Tensor, ctx, autocast=nullcontext,
                         timer=NoTimer()):
        out = self.run(micro_batches, weights, ctx, autocast, timer=timer)
        timer.mark("backward")
        return out

    def finish_grads(self, max_norm: float) -> torch.Tensor | None:
        lay = layout()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if lay.dp > 1:  # the weights carry a factor dp (see the trainer): the mean is the step's gradient
            all_reduce_flat([p.grad for p in params], lay.dp_group, "data-parallel grads", scale=1.0 / lay.dp)
        all_reduce_tp_grads([p.grad for p in self.sp_params if p.grad is not None])
        tied = [p.grad for p in self.tied if p.grad is not None]
        if tied:
            all_reduce_flat(tied, lay.embedding_group, "tied weights' grads over the first and last stage")
        counted = [p for p in params if not (lay.last_stage and getattr(p, TIED, False))]  # the tied copy once
        total = grad_square_sum(counted, next(self.model.parameters()).device).reshape(1)
        collective("all_reduce(grad norm over stages)", dist.all_reduce, total, group=lay.pp_group)
        norm = total[0].sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


class MegatronPipelineEngine(PipelineEngine):
    """Pipeline stages whose data parallelism is megatron-core's DDP, optionally with its distributed
    optimizer (parallel.data_parallel=megatron): the schedule runs as above; megatron's gradient hooks
    accumulate into its buffers during it (overlap_grad_reduce is off, so nothing is reduced before
    finish_grads and the schedule needs no no_sync), and its optimizer steps the stage's parameters.

    A tied weight's two gradients are summed over the embedding group before the data-parallel
    reduction (a sum, so the order is free, and under the distributed optimizer the reduce-scatter
    then sees the whole gradient); the last stage's copy is marked `shared`, which megatron's
    gradient norm skips, and its norm is reduced over the model-parallel group, stages included."""

    name = "pipeline-megatron"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, settings, chunks: list[Stage]):
        from parallel.megatron_ddp import MegatronEngine, MegatronState

        super().__init__(model, optimizer, settings, chunks)
        if chunks[-1].last:
            for p in self.tied:
                p.shared = True
        self.dp_engine = MegatronEngine(model, optimizer, settings)
        self.optimizer = self.dp_engine.optimizer
        self.state = FullState(PipelineState(MegatronState(self.dp_engine), model), model)

    def _data_parallel(self) -> str:
        return ", " + self.dp_engine.describe()

    def finish_grads(self, max_norm: float) -> torch.Tensor:
        tied = [p.main_grad for p in self.tied]
        if tied:
            all_reduce_flat(tied, layout().embedding_group, "tied weights' grads over the first and last stage")
        return self.dp_engine.finish_grads(max_norm)

    def step(self) -> None:
        self.dp_engine.step()

    def zero_grad(self) -> None:
        self.dp_engine.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.dp_engine.set_lr(lr)


class PipelineForward(nn.Module):
    """The stage as evaluation calls a model: model(batch, ctx) -> (loss, diagnostics), run through the
    pipeline forward-only (every rank returns the same figures); train()/eval() reach the stage."""

    def __init__(self, engine: PipelineEngine):
        super().__init__()
        self.stage_model = engine.model
        self._engine = [engine]  # not a submodule

    def forward(self, batch, ctx):
        with torch.no_grad():
            loss, diagnostics = self._engine[0].run([batch], None, ctx, forward_only=True)
        return loss, diagnostics
