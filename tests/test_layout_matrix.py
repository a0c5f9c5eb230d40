"""Every registered architecture under every parallel layout it supports equals one process; every
layout it does not support is refused by validate() with a sentence.

Parametrized over the registry, so an architecture that registers later is covered at once. CI runs
each architecture under TP2 and under ZeRO-3; the full matrix is marked slow (`-m slow`).
"""
import numpy as np
import pytest

import looped_model  # noqa: F401  (registers the test architectures, also in spawned ranks)
from distributed import run_ranks
from pretrain.config import ConfigError, load_config
from pretrain.models import all_archs, get_arch
from trainer_helpers import step_losses, tiny_overrides, train_run, write_markov_corpus

ARCHS = [s.name for s in all_archs() if not s.name.startswith("test_")]
LAYOUTS = {  # name: (ranks, overrides)
    "ddp2": (2, []),
    "megatron-ddp": (2, ["parallel.data_parallel=megatron"]),
    "megatron-distopt": (2, ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"]),
    "zero1": (2, ["parallel.data_parallel=deepspeed", "parallel.zero_stage=1"]),
    "zero2": (2, ["parallel.data_parallel=deepspeed", "parallel.zero_stage=2"]),
    "zero3": (2, ["parallel.data_parallel=deepspeed", "parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "tp2xdp2": (4, ["parallel.tp=2", "parallel.data_parallel=megatron"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2xpp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "pp2xdp2": (4, ["parallel.pp=2"]),
    "pp4": (4, ["parallel.pp=4", "model.n_layers=4"]),  # middle stages: neither embedding nor head
    # interleaved 1F1B: eight stages, two per rank (eight micro batches per step: a multiple of pp, twice it)
    "pp4-vp2": (4, ["parallel.pp=4", "parallel.virtual_stages=2", "model.n_layers=8", "train.micro_batch_seqs=2",
                    "train.global_batch_seqs=16"]),
    "pp2xdp2-megatron": (4, ["parallel.pp=2", "parallel.data_parallel=megatron"]),
    "pp2xdp2-distopt": (4, ["parallel.pp=2", "parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"]),
}
CI_SUBSET = ("tp2", "zero3", "pp2")
BASE = ["train.compile=false"]
LOSS_REL, PARAM_ATOL = 1e-5, 2e-5  # see test_parallel_layouts.py


def parallel_config(layout):
    """The ParallelConfig a layout's overrides set (what the registry's Support judges)."""
    from pretrain.run_config import ParallelConfig

    def value(text):
        return text == "true" if text in ("true", "false") else int(text) if text.isdigit() else text

    pairs = (over.split("=", 1) for over in LAYOUTS[layout][1])
    return ParallelConfig(**{k.removeprefix("parallel."): value(v) for k, v in pairs if k.startswith("parallel.")})


def needs(layout):
    """Skip, naming the missing package, when the layout's engine is not installed."""
    from parallel.mesh import uses_megatron

    pc = parallel_config(layout)
    if uses_megatron(pc):
        pytest.importorskip("megatron.core", reason="tensor/pipeline parallelism and megatron DDP need megatron-core")
    if pc.data_parallel == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs DeepSpeed (DS_BUILD_OPS=0 pip install --no-build-isolation "
                                                "deepspeed)")


def _config(arch):
    """Each architecture's shipped tiny config; the test architectures reuse the baseline's."""
    return "baseline/tiny" if arch.startswith("test_") else f"{arch}/tiny"


def _refusal(arch, extra, tmp_path):
    """None if `arch` supports the layout, else the ConfigError's sentence."""
    over = tiny_overrides(tmp_path, "unused", **{"model.arch": arch}) + BASE + extra
    try:
        load_config(_config(arch), over, check_data=False)
    except ConfigError as e:
        return str(e)
    return None


def _body(rank, world_size, tmp, corpus, archs, extra):
    return {arch: train_run(tmp, corpus, f"layout-{arch}", 3, BASE + extra, arch_config=_config(arch))[1]
            for arch in archs}


_SPAWNS: dict = {}  # layout -> (its folder, {arch: every rank's parameters}) or the spawn's exception


def _spawned(layout, tmp_path_factory, corpus):
    """One spawn per layout trains every architecture that supports it, one after another in the same ranks
    (process start-up and the imports cost more than a tiny run: about 8 s of each 12 s test)."""
    if layout not in _SPAWNS:
        ranks, extra = LAYOUTS[layout]
        tmp = str(tmp_path_factory.mktemp(f"layout-{layout}"))
        archs = [a for a in ARCHS if _refusal(a, extra, tmp) is None]
        try:
            held = run_ranks(_body, ranks, args=(tmp, corpus, archs, extra), env={"DS_ACCELERATOR": "cpu"},
                             timeout=600)
            _SPAWNS[layout] = tmp, {a: {k: v for rank in held for k, v in rank[a].items()} for a in archs}
        except Exception as e:  # every architecture's test of this layout reports it, without spawning again
            _SPAWNS[layout] = e
    if isinstance(_SPAWNS[layout], Exception):
        raise _SPAWNS[layout]
    return _SPAWNS[layout]


def _check(arch, layout, tmp_path, corpus, tmp_path_factory):
    _, extra = LAYOUTS[layout]
    needs(layout)
    refused = _refusal(arch, extra, tmp_path)
    if refused:  # a refusal is an outcome to check, not a skip: it must quote the registry's reason
        reasons = get_arch(arch).supports.reasons
        if layout.startswith("pp") and "pp" not in reasons:  # no stages of its own: the registry has no split
            assert "no pipeline_split in its registry entry" in refused, refused
            return
        assert any(r in refused for r in reasons.values()), f"{arch} refuses {layout} without a registry reason: {refused}"
        return
    tmp = str(tmp_path)
    # the layout's model (e.g. depth for PP4) and batch in both runs
    model = [o for o in extra if o.startswith(("model.", "train."))]
    _, single = train_run(tmp, corpus, "single", 3, BASE + model, arch_config=_config(arch))
    spawn_tmp, trained = _spawned(layout, tmp_path_factory, corpus)
    params = trained[arch]  # every rank's view merged (a pipeline stage holds its own tensors; the others hold all)
    got, want = step_losses(f"{spawn_tmp}/layout-{arch}"), step_losses(f"{tmp}/single")
    assert sorted(got) == [1, 2, 3] and got == pytest.approx(want, rel=LOSS_REL)
    for k in single:
        np.testing.assert_allclose(params[k], single[k], rtol=0, atol=PARAM_ATOL, err_msg=k)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


@pytest.mark.parametrize("layout", CI_SUBSET)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_under_tp2_and_zero3(arch, layout, tmp_path, corpus, tmp_path_factory):
    _check(arch, layout, tmp_path, corpus, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x not in CI_SUBSET])
@pytest.mark.parametrize("arch", ARCHS)
def test_full_architecture_by_layout_matrix(arch, layout, tmp_path, corpus, tmp_path_factory):
    _check(arch, layout, tmp_path, corpus, tmp_path_factory)


@pytest.mark.parametrize("layout, needle", [
    ("tp2", "parallel.tp=2 is not supported (its time loop is strictly sequential)"),
    ("tp2-sp", "parallel.tp=2 is not supported"),
    ("zero3", "parallel.zero_stage=3 is not supported (not shown to work yet)"),
])
def test_unsupported_layouts_are_refused_with_their_reason(layout, needle, tmp_path):
    message = _refusal("test_looped_restricted", LAYOUTS[layout][1], tmp_path)
    assert message is not None and needle in message and "\n" not in message
    assert _refusal("test_looped_restricted", LAYOUTS["zero2"][1], tmp_path) is None
