"""The process layout of a run: tensor-parallel x data-parallel x pipeline groups, set up once per process.

    layout = setup_layout(cfg.parallel)      # after init_distributed, before the model is built
    layout.tp_group, layout.dp_rank, ...

Ranks are ordered as megatron-core orders them (tp fastest, pipeline slowest: rank = (pp_rank * dp +
dp_rank) * tp + tp_rank). When a run uses megatron-core at all (TP > 1, pipeline stages, its layers
forced at TP = 1, or its DDP), megatron's parallel_state is initialised and its groups are ours;
otherwise every rank is its own TP group and the data-parallel group is the whole world, with no
megatron import.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Layout:
    tp: int = 1
    dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    sp: bool = False  # sequence parallelism inside the TP group
    megatron: bool = False  # megatron-core's parallel_state is initialised (its groups are these)
    megatron_layers: bool = False  # the parallel.layers facades build megatron-core's layers
    tp_group: Any = None  # None = no group (size 1)
    dp_group: Any = None  # None = the default group (or no process group at all)
    pp: int = 1  # pipeline stages
    pp_rank: int = 0
    pp_group: Any = None
    embedding_group: Any = None  # the first and last stages (a weight tied across them is summed there)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


_LAYOUT = Layout()


def layout() -> Layout:
    return _LAYOUT


@contextlib.contextmanager
def single_device():
    """Build models as one process would, whatever layout this process has set up (the parallel.layers
    facades read the layout when a layer is built): for shape checks on the meta device."""
    global _LAYOUT
    saved, _LAYOUT = _LAYOUT, Layout()
    try:
        yield
    finally:
        _LAYOUT = saved


def uses_megatron(parallel) -> bool:
    return parallel.tp > 1 or parallel.pp > 1 or parallel.megatron_layers or parallel.data_parallel == "megatron"


def _ensure_process_group(timeout_s: float) -> None:
    """megatron-core (and DeepSpeed) need a process group even for one process: a private one-rank group,
    gloo, and on a GPU NCCL beside it (gloo's collectives do not all take CUDA tensors)."""
    if dist.is_initialized():
        return
    import tempfile

    from parallel.dist import GPU_BACKEND

    store = os.path.join(tempfile.mkdtemp(prefix="pg-"), "store")
    dist.init_process_group(GPU_BACKEND if torch.cuda.is_available() else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s))


def setup_layout(parallel) -> Layout:
    """Build the groups `parallel` (a ParallelConfig) asks for; the world must be tp x dp x pp ranks."""
    global _LAYOUT
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world % (parallel.tp * parallel.pp):
        raise ValueError(f"parallel.tp x parallel.pp = {parallel.tp} x {parallel.pp} does not divide the {world} "
                         "ranks of this job")
    if not uses_megatron(parallel):
        _LAYOUT = Layout(tp=1, dp=world, dp_rank=rank)
        return _LAYOUT
    _ensure_process_group(parallel.timeout_s)
    from parallel import cpu_shim

    cpu_shim.install()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and (ps.get_tensor_model_parallel_world_size(),
                                               ps.get_pipeline_model_parallel_world_size()) != (parallel.tp, parallel.pp):
        ps.destroy_model_parallel()  # another layout in the same process (tests)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
                                     distributed_timeout_minutes=max(1, int(parallel.timeout_s // 60)),
                                     # torch's fake process group (pretrain plan --dry-run) makes no gloo groups
                                     create_gloo_process_groups=dist.get_backend() != "fake")
    tp_group = ps.get_tensor_model_parallel_group()
    pp = parallel.pp
    _LAYOUT = Layout(tp=parallel.tp, dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                     dp_rank=ps.get_data_parallel_rank(), sp=parallel.sp, megatron=True,
                     megatron_layers=parallel.tp > 1 or parallel.megatron_layers, tp_group=tp_group,
                     dp_group=ps.get_data_parallel_group(), pp=pp,
                     pp_rank=ps.get_pipeline_model_parallel_rank() if pp > 1 else 0,
                     pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
                     embedding_group=ps.get_embedding_group(check_initialized=False) if pp > 1 else None)
    return _LAYOUT


def teardown_layout() -> None:
    """Forget the layout (tests run several layouts in one process)."""
    global _LAYOUT
    if _LAYOUT.megatron:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    _LAYOUT = Layout()

