"""DeepSpeed ZeRO-1/2/3 (parallel/zero.py) on 2 gloo ranks: the same losses and parameters as one
process on the same global batch, checkpoints identical in layout to a single process's, and
checkpoints that move between ZeRO and the plain engine in both directions.

One spawn of 2 ranks runs everything multi-rank (process start-up and the DeepSpeed import dominate):
ZeRO-1/2/3 for 3 steps each, a single-process checkpoint resumed under ZeRO-2 and ZeRO-3, an
engine-level run of a model that applies one block three times under activation checkpointing, and
the checkpoint view's round trip of parameters whose sizes 2 ranks do not split evenly. ZeRO-3
runs with stage3_param_persistence_threshold=0: by default it would keep every parameter of these
tiny models whole (under 1e5 elements), and parameter partitioning would go untested.

Tolerances (fp32): losses rel 1e-5. Parameters after AdamW: the layouts sum gradients in different
orders, and Adam's normalisation m / sqrt(v) turns the rounding of an element whose gradient is ~0
into a visible step (up to lr), so a handful of such elements differ by a few 1e-6 while the rest
agree to ~1e-7: at most 0.1% of the elements may differ by more than 2e-6, none by more than 2e-5.
Adam moments: rel 1e-3 with an absolute floor of 1e-4 x the tensor's largest element.
"""
import os
import shutil
import sys
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_ranks
from trainer_helpers import VOCAB, partition_everything_under_zero3, step_losses, train_run, write_markov_corpus

STAGES = (1, 2, 3)
ZERO = ["parallel.data_parallel=deepspeed", "train.compile=false"]
CKPT3 = "checkpoints/step_00000003"


def _needs_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed",
                        reason="needs DeepSpeed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")


def assert_params_close(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), what
    for k in want:
        diff = np.abs(np.asarray(got[k]) - np.asarray(want[k]))
        assert diff.max() <= 2e-5, f"{what}: {k} differs by {diff.max():.2e}"
        assert (diff > 2e-6).mean() <= 1e-3, f"{what}: {k}: {(diff > 2e-6).sum()} elements differ by > 2e-6"


def assert_moments_close(got, want, what):
    """Adam moments: gradients that differ by rounding, judged against the tensor's own scale (an
    element near 0 has no relative precision after the sums of other elements cancel)."""
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * float(np.abs(want).max()), err_msg=what)


def _train(tmp, corpus, run, steps, extra=()):
    """trainer_helpers.train_run with micro batches of 2, so that 2 ranks accumulate 2 per step."""
    return train_run(tmp, corpus, run, steps, ["train.micro_batch_seqs=2"] + list(extra))


# -- a model that applies one block three times per step, with activation checkpointing ------------

class LoopedBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        from parallel.layers import ColumnLinear, RowLinear

        self.up, self.down = ColumnLinear(d, 2 * d), RowLinear(2 * d, d)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class LoopedModel(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        from parallel.layers import LMHead, VocabEmbedding

        self.embed = VocabEmbedding(VOCAB, d)
        self.block = LoopedBlock(d)
        self.gain = nn.Parameter(torch.ones(d))  # a vector: the no-decay param group
        self.head = LMHead(d, VOCAB, tied=self.embed)  # used through .loss(), not forward

    def forward(self, batch, ctx=None):
        h = self.embed(batch.tokens)
        for _ in range(3):
            h = self.block(h)
        return self.head.loss(h * self.gain, batch.labels, batch.loss_mask), {}


def looped_batches(n=8, t=12):
    from pretrain.data.batch import Batch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n, t + 1), generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3  # uneven token counts: the weights matter
    pos = torch.arange(t).expand(n, t)
    return Batch(tokens[:, :-1], tokens[:, 1:], mask, torch.zeros(n, t, dtype=torch.int32), pos)


def run_looped(engine_cls, stage, rank, world, plan=(True, False, True), micro=2):
    """The trainer's step (token-weighted micro batches, boundary on the last) on this rank's share of
    a fixed global batch, stepping or, where `plan` says False, dropping the gradients as the trainer
    does for a non-finite loss; returns the checkpoint view before the first step and after the last."""
    from parallel.recompute import apply_recompute
    from pretrain.data.batch import Batch
    from pretrain.models.base import StepContext
    from pretrain.optim import OptimConfig

    EVAL_CTX = StepContext()  # (LoopedModel ignores it)

    torch.manual_seed(0)
    model = LoopedModel()
    apply_recompute([model.block])
    from parallel.engine import EngineSettings
    from pretrain.optim import build_optimizer

    settings = EngineSettings(SimpleNamespace(zero_stage=stage, timeout_s=60.0), grad_clip=1.0,
                              micro_batch_seqs=micro, global_batch_seqs=8)
    engine = engine_cls(model, build_optimizer(model, OptimConfig(lr=1e-2, min_lr=1e-3, grad_clip=1.0)), settings)
    full = looped_batches()
    total = full.loss_mask.sum().float()
    share = 8 // world
    mine = [Batch(*(getattr(full, f.name)[rank * share + i:rank * share + i + micro] for f in fields(Batch)))
            for i in range(0, share, micro)]
    before = _numpy(engine.get_state())  # now: the plain engine hands over its live tensors
    for apply in plan:
        engine.set_lr(1e-2)
        for i, b in enumerate(mine):
            with engine.accumulating(last=i == len(mine) - 1):
                loss, _ = engine.forward(b, EVAL_CTX)
                engine.backward(loss * (b.loss_mask.sum() * world / total))
        norm = engine.finish_grads(1.0)
        if apply:
            engine.step()
            norm = engine.grad_norm_after_step() if norm is None else norm
        engine.zero_grad()
    return before, _numpy(engine.get_state()), float(norm), masters_are_the_model(engine)


class OddSizes(nn.Module):
    """Parameters of sizes 2 ranks do not split evenly: ZeRO-3 pads their partitions (a 1-element
    parameter leaves the second rank nothing but padding)."""

    def __init__(self):
        super().__init__()
        self.vectors = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in (1, 3, 5, 7))  # no decay
        self.matrix = nn.Parameter(torch.zeros(3, 5))  # the decay group

    def forward(self, x):
        return sum(v.sum() for v in self.vectors) + self.matrix.sum() * x


def odd_sizes_round_trip(stage):
    """The checkpoint view of a ZeRO engine over OddSizes: set_state with known full tensors (master
    weights and Adam moments), then (what set_state was given, what get_state hands back)."""
    from parallel.engine import EngineSettings
    from parallel.mesh import setup_layout
    from parallel.zero import DeepSpeedEngine
    from pretrain.optim import OptimConfig, build_optimizer
    from pretrain.run_config import ParallelConfig

    model = OddSizes()
    parallel = ParallelConfig(data_parallel="deepspeed", zero_stage=stage, timeout_s=60.0)
    setup_layout(parallel)  # every rank data-parallel
    settings = EngineSettings(parallel, grad_clip=1.0, micro_batch_seqs=2, global_batch_seqs=8)
    engine = DeepSpeedEngine(model, build_optimizer(model, OptimConfig(lr=1e-2, min_lr=1e-3)), settings)
    g = torch.Generator().manual_seed(stage)  # the same values on every rank
    model_sd = {k: torch.randn(v.shape, generator=g) for k, v in engine.model_template().items()}
    optim_state = {name: {k: torch.tensor(3.0) if k == "step" else torch.randn(v.shape, generator=g).abs()
                          for k, v in entry.items()} for name, entry in engine.optim_template().items()}
    engine.set_state(model_sd, optim_state, engine.get_state()[1]["param_groups"])
    return _numpy((model_sd, optim_state)), _numpy(engine.get_state())


def masters_are_the_model(engine) -> bool | None:
    """Whether the optimizer steps the model's own flat partitions (fp32 ZeRO-1/2), checked by address."""
    if getattr(engine, "stage", 0) not in (1, 2):
        return None
    import torch.distributed as dist

    z = engine.zero
    return engine.shared_masters and all(
        m.data_ptr() == z.parallel_partitioned_bit16_groups[i][dist.get_rank()].data_ptr()
        for i, m in enumerate(z.single_partition_of_fp32_groups))


def _numpy(tree):
    """Tensors as numpy arrays (they cross the process boundary; shapes and dtypes stay comparable)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().numpy().copy()
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_numpy(v) for v in tree)
    return tree


# -- the spawned ranks -------------------------------------------------------------------------------

def _zero_body(rank, world_size, tmp, corpus):
    import torch.distributed as dist

    from parallel.zero import DeepSpeedEngine

    partition_everything_under_zero3()

    out = {}
    for stage in STAGES:  # ZeRO-3 with activation checkpointing on
        recompute = ["parallel.recompute=full"] if stage == 3 else []
        out[stage] = _train(tmp, corpus, f"zero{stage}", 3, ZERO + [f"parallel.zero_stage={stage}"] + recompute)
    for stage in (2, 3):  # the single process's step-3 checkpoint, resumed under ZeRO for 2 more steps
        if rank == 0:
            shutil.copytree(f"{tmp}/single", f"{tmp}/single_to_zero{stage}")
        dist.barrier()
        out[f"from_single{stage}"] = _train(tmp, corpus, f"single_to_zero{stage}", 5,
                                            ZERO + [f"parallel.zero_stage={stage}"])[1]
    for stage in STAGES:
        out[f"looped{stage}"] = run_looped(DeepSpeedEngine, stage, rank, world_size)
        out[f"odd{stage}"] = odd_sizes_round_trip(stage)
    return out


def _one_rank_body(rank, world_size, tmp, corpus):
    import torch.distributed as dist

    assert not dist.is_initialized()  # the engine must make its own one-rank group
    os.environ.pop("DS_ACCELERATOR", None)  # and choose the CPU accelerator itself
    os.environ.pop("LOCAL_RANK", None)  # a plain process: no launcher variables at all
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    partition_everything_under_zero3()
    return _train(tmp, corpus, "zero3_one_rank", 3, ZERO + ["parallel.zero_stage=3"])


# -- fixtures: the single-process references and the one 2-rank spawn --------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _needs_deepspeed()
    tmp = str(tmp_path_factory.mktemp("zero"))
    corpus = write_markov_corpus(f"{tmp}/markov")
    single = _train(tmp, corpus, "single", 3)
    single5 = _train(tmp, corpus, "single5", 5)[1]
    extensions = f"{tmp}/torch_extensions"  # what the ranks JIT-build, if anything
    os.makedirs(extensions)
    ranks = run_ranks(_zero_body, 2, args=(tmp, corpus), env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extensions},
                      timeout=600)
    return SimpleNamespace(tmp=tmp, corpus=corpus, single=single, single5=single5, ranks=ranks, extensions=extensions)


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _checkpoint(path, out):
    """A DCP checkpoint as {dotted key: tensor} (rng dropped) and its optim.json text."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)
    flat = dict(_flatten(torch.load(out, weights_only=True)))
    with open(os.path.join(path, "optim.json")) as f:
        return {k: v for k, v in flat.items() if not k.startswith("rng.")}, f.read()


# -- the tests ---------------------------------------------------------------------------------------

def test_zero_stages_equal_one_process(runs):
    (single_record, single_params), tmp = runs.single, runs.tmp
    ref_losses = step_losses(f"{tmp}/single")
    ref_ckpt, ref_groups = _checkpoint(f"{tmp}/single/{CKPT3}", f"{tmp}/single.pt")
    for stage in STAGES:
        (rec0, p0), (_, p1) = runs.ranks[0][stage], runs.ranks[1][stage]
        for k in p0:  # both ranks hand over the same full tensors
            np.testing.assert_array_equal(p0[k], p1[k])
        losses = step_losses(f"{tmp}/zero{stage}")
        assert sorted(losses) == [1, 2, 3]
        for step in (1, 2, 3):
            assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (stage, step)
        assert rec0["val_loss"] == pytest.approx(single_record["val_loss"], rel=1e-5)
        assert rec0["grad_norm"] == pytest.approx(single_record["grad_norm"], rel=1e-4)
        assert_params_close(p0, single_params, f"ZeRO-{stage}")

        # The checkpoint ZeRO wrote holds what the single process's holds: same keys, shapes, dtypes
        # (model incl. the tied head.weight, optimizer step/exp_avg/exp_avg_sq per FQN), same groups.
        ckpt, groups = _checkpoint(f"{tmp}/zero{stage}/{CKPT3}", f"{tmp}/zero{stage}.pt")
        assert groups == ref_groups
        assert sorted(ckpt) == sorted(ref_ckpt)
        for k, want in ref_ckpt.items():
            got = ckpt[k]
            assert (got.shape, got.dtype) == (want.shape, want.dtype), k
            if k.endswith(".step"):
                assert float(got) == float(want) == 3.0, k
            elif k.startswith("optim."):  # the moments of gradients that agree to rounding
                assert_moments_close(got.numpy(), want.numpy(), k)


def test_zero3_checkpoint_resumes_in_one_process(runs):
    """ZeRO-3 (2 ranks) -> plain engine (1 process): 3 + 2 steps equal 5 uninterrupted steps, so the
    optimizer state came across (without it the moments would restart from zero)."""
    tmp = runs.tmp
    shutil.copytree(f"{tmp}/zero3", f"{tmp}/zero3_to_single")
    _, resumed = _train(tmp, runs.corpus, "zero3_to_single", 5)
    assert sorted(step_losses(f"{tmp}/zero3_to_single")) == [1, 2, 3, 4, 5]
    assert_params_close(resumed, runs.single5, "ZeRO-3 -> single")


@pytest.mark.parametrize("stage", [2, 3])
def test_single_checkpoint_resumes_under_zero(runs, stage):
    p0, p1 = (r[f"from_single{stage}"] for r in runs.ranks)
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k])
    assert_params_close(p0, runs.single5, f"single -> ZeRO-{stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_looped_block_with_recompute_matches_plain_engine(runs, stage):
    """One block applied three times per step, activation checkpointing, a tied head used through a
    method: gradients reduced once per step, none left over from a skipped step, and the checkpoint
    view equals the plain engine's."""
    from parallel.engine import Engine

    ref_before, ref_after, ref_norm, _ = run_looped(Engine, 0, 0, 1)
    before, after, norm, shared = runs.ranks[0][f"looped{stage}"]
    assert shared is {1: True, 2: True, 3: None}[stage]  # fp32 ZeRO-1/2 step the model's own memory
    assert before[1]["state"] == {} and before[1]["param_groups"] == ref_before[1]["param_groups"]
    assert sorted(before[0]) == sorted(ref_before[0]) == ["block.down.weight", "block.up.weight",
                                                          "embed.weight", "gain", "head.weight"]
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    (model, optim), (ref_model, ref_optim) = after, ref_after
    assert optim["param_groups"] == ref_optim["param_groups"]
    assert_params_close(model, ref_model, f"looped ZeRO-{stage}")
    assert sorted(optim["state"]) == sorted(ref_optim["state"])
    for name, want in ref_optim["state"].items():
        got = optim["state"][name]
        assert sorted(got) == sorted(want) == ["exp_avg", "exp_avg_sq", "step"]
        for k in want:
            assert (got[k].shape, got[k].dtype) == (want[k].shape, want[k].dtype), f"{name}.{k}"
            assert_moments_close(got[k], want[k], f"{name}.{k}")


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_of_odd_sizes_round_trip(runs, stage):
    """Full tensors of 1, 3, 5, 7 and 3 x 5 elements scattered into 2 ranks' (padded) partitions
    and gathered back are unchanged on every rank, master weights and Adam moments alike."""
    for rank, result in enumerate(runs.ranks):
        (model_sd, optim_state), (got_model, got_optim) = result[f"odd{stage}"]
        assert sorted(model_sd) == sorted(got_model) == ["matrix", "vectors.0", "vectors.1", "vectors.2", "vectors.3"]
        for k, want in model_sd.items():
            np.testing.assert_array_equal(got_model[k], want, err_msg=f"rank {rank}: {k}")
        assert sorted(got_optim["state"]) == sorted(optim_state)
        for name, entry in optim_state.items():
            for k, want in entry.items():
                np.testing.assert_array_equal(got_optim["state"][name][k], want, err_msg=f"rank {rank}: {name}.{k}")


def test_zero3_on_one_process_equals_plain(runs):
    """World size 1 (no process group from the launcher, no DS_ACCELERATOR): the engine makes a one-rank
    group and picks DeepSpeed's CPU accelerator."""
    tmp = runs.tmp
    ((_, params),) = run_ranks(_one_rank_body, 1, args=(tmp, runs.corpus), timeout=300)
    ref_losses, losses = step_losses(f"{tmp}/single"), step_losses(f"{tmp}/zero3_one_rank")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(params, runs.single[1], "ZeRO-3 on one rank")


def test_missing_deepspeed_says_how_to_install(monkeypatch):
    from parallel.zero import _import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(ImportError, match="DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"):
        _import_deepspeed()


def test_deepspeed_comm_is_started_without_building_its_shared_memory_op(runs):
    """ZeRO's collectives never use DeepSpeed's shared-memory all-reduce (inference only), whose JIT build
    costs about 45 s on a CPU: the engine skips it, and puts DeepSpeed's builder back afterwards."""
    import importlib

    from parallel.zero import _init_comm

    ds_comm = importlib.import_module("deepspeed.comm.torch")
    real, during = ds_comm.build_shm_op, []

    def init_distributed(dist_backend):
        during.append(importlib.import_module("deepspeed.comm.torch").build_shm_op())

    _init_comm(SimpleNamespace(init_distributed=init_distributed), "gloo")
    assert during == [None] and ds_comm.build_shm_op is real
    # the 2-rank ZeRO runs above (the same engine) built nothing
    assert all(not name.startswith("deepspeed_shm_comm") for name in os.listdir(runs.extensions)), \
        os.listdir(runs.extensions)
