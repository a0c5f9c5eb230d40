"""Parallelism as one transform: how a single-device model becomes a model trained over many ranks.

    engine = parallelize(build, settings, make_optimizer, recompute=..., compile=...)

applies, in this order (torchtitan's; each step needs the one before it):
1. the layout: megatron-core's parallel state for TP x DP x PP (parallel/mesh.py); `build()` then
   runs under it, so the parallel.layers facades build TP/SP-split layers where the model asks for
   linears, embeddings and norms; with pipeline stages, the model keeps this rank's stage only;
2. activation recompute, when `parallel.recompute` asks for it: the architecture's policy
   (parallel/recompute.py's Recompute) either wraps modules in checkpointing or configures the model
   to recompute by itself (segments of a time loop, a custom backward);
3. compile: `torch.compile` of the model's forward, in place (parameter names and the module stay
   the same for checkpoints and the engines); with compile_scope "blocks", the model's `compile_blocks`
   (each block apart, where the model has one; its own `compile` otherwise);
4. the data-parallel engine `parallel.data_parallel` names (the pipeline engine with stages), around the
   model and the optimizer
   `make_optimizer(model)` builds (the trainer's; the engine may shard it or, for megatron, build
   its own from its hyperparameters).
The trainer calls it once; nothing else in the code applies parallelism to a model.
"""
from __future__ import annotations

from typing import Callable

import torch

from parallel.engine import Engine, EngineSettings
from parallel.mesh import setup_layout
from parallel.recompute import Recompute, as_policy


def parallelize(build: Callable[[], torch.nn.Module], settings: EngineSettings,
                make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
                recompute: Recompute | Callable[[torch.nn.Module], list] | None = None,
                compile: bool = False, pipeline_split: Callable[[int], list] | None = None,
                compile_scope: str = "model") -> Engine:
    """The engine around the model `build()` makes, with the steps of the module docstring applied;
    `recompute` is the activation-recompute policy chosen (a Recompute, or a bare function model ->
    modules to wrap), or None; `pipeline_split(n)` gives the boundaries of n stages under parallel.pp > 1
    (n = pp x parallel.virtual_stages; this rank keeps its stages, parallel/stages.py's Stage.chunks)."""
    parallel = settings.parallel
    lay = setup_layout(parallel)  # 1
    model = build()
    chunks = None
    if lay.pp > 1:  # the whole model is built (the same initialisation as one process), then cut
        from parallel.stages import Stage, units_of

        virtual = getattr(parallel, "virtual_stages", 1)
        chunks = Stage.chunks(pipeline_split(lay.pp * virtual), virtual)
        model.keep_stage(units_of(chunks), chunks[0].first, chunks[-1].last)
    if recompute is not None:  # 2
        as_policy(recompute).apply(model)
    if compile:  # 3
        scoped = getattr(model, "compile_blocks", None) if compile_scope == "blocks" else None
        (scoped or model.compile)()
    if chunks is not None:  # 4
        from parallel.pipeline import MegatronPipelineEngine, PipelineEngine

        cls = MegatronPipelineEngine if parallel.data_parallel == "megatron" else PipelineEngine
        return cls(model, make_optimizer(model), settings, chunks)
    return engine_class(parallel.data_parallel)(model, make_optimizer(model), settings)  # 4


def engine_class(data_parallel: str) -> type[Engine]:
    """The engine parallel.data_parallel names (its module imported only when chosen). Here, not in
    parallel/engine.py, which its subclasses import."""
    if data_parallel == "megatron":
        from parallel.megatron_ddp import MegatronEngine

        return MegatronEngine
    if data_parallel == "deepspeed":
        from parallel.zero import DeepSpeedEngine

        return DeepSpeedEngine
    return Engine
