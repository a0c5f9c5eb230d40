"""checkpoint.init_from (pretrain/init_from.py): a new run starts from another run's weights, as they
are or converted through the registry's `convert`, with a fresh optimizer, step and data order;
what cannot be loaded is refused in validate() in one sentence; a run with its own checkpoint
resumes it; TP2 and ZeRO-3 start from the weights one process does; the path is relocatable."""
import importlib.util
import os
import shutil
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import torch

import looped_model  # noqa: F401  (registers test_looped: an architecture without convert)
from distributed import run_ranks
from parallel.layers import RMSNorm
from pretrain.config import ConfigError, load_config
from pretrain.models import baseline, blocks, decoder
from pretrain.models.base import EVAL
from pretrain.models.registry import ArchSpec, register
from pretrain.trainer import Trainer
from trainer_helpers import partition_everything_under_zero3, step_losses, tiny_overrides, write_markov_corpus


# -- a test-only architecture with a conversion from baseline ---------------------------------------
# The baseline plus a correction FFN in each block whose output layer the conversion sets to zero
# (as the CRT paper converts a transformer), so the converted model computes the source's function.

@dataclass
class CorrectedConfig(baseline.BaselineConfig):
    arch: str = "test_corrected"


class CorrectedBlock(blocks.Block):
    def __init__(self, cfg, depth):
        super().__init__(cfg.block_options(depth))
        self.corr_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.correction = blocks.mlp(cfg.block_options(depth))

    def forward(self, h, a):
        h = super().forward(h, a)
        return h + self.correction(self.corr_norm(h))


class Corrected(baseline.TransformerPP):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = torch.nn.ModuleList(CorrectedBlock(cfg, cfg.n_layers) for _ in range(cfg.n_layers))


CALLS = []  # (arguments, returned state) of every convert call in this process


def convert(source_arch, source_cfg, source_state, target_cfg):
    if source_arch != "baseline":
        raise ValueError(f"test_corrected converts only from baseline, not {source_arch!r}")
    for name in ("d_model", "n_layers", "n_heads", "vocab_size", "ffn"):
        if getattr(source_cfg, name) != getattr(target_cfg, name):
            raise ValueError(f"model.{name} {getattr(target_cfg, name)} differs from the source's "
                             f"{getattr(source_cfg, name)}")
    out = dict(source_state)
    for i in range(target_cfg.n_layers):
        p = f"blocks.{i}."
        out[p + "corr_norm.weight"] = torch.ones_like(source_state[p + "ffn_norm.weight"])
        for w in ("gate", "up"):
            out[p + f"correction.{w}.weight"] = source_state[p + f"ffn.{w}.weight"].clone()
        out[p + "correction.down.weight"] = torch.zeros_like(source_state[p + "ffn.down.weight"])
    CALLS.append(((source_arch, source_cfg, source_state, target_cfg), out))
    return out


CORRECTED = register(ArchSpec(name="test_corrected", config_cls=CorrectedConfig, build=Corrected,
                              flops_per_token=baseline.flops_per_token, tp_dims=decoder.tp_dims,
                              convert=convert))


# -- runs -------------------------------------------------------------------------------------------

def config(tmp, corpus, name, steps, *extra, **fields):
    """A one-layer tiny run of `steps` steps, one micro batch a step, constant lr (runs of different
    lengths share their lrs), a checkpoint at the end."""
    values = {"train.run_dir": f"{tmp}/{name}", "model.n_layers": 1, "train.max_steps": steps,
              "train.eval_every": 0, "checkpoint.every": 0, "train.micro_batch_seqs": 8,
              "schedule.warmup_steps": 1, "schedule.kind": "constant", **fields}
    return load_config("baseline/tiny", tiny_overrides(tmp, corpus, **values) + list(extra))


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.engine.get_state()[0].items()}


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def one_line(excinfo) -> str:
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):
    """A trained source run: (run directory, its final weights, its model config)."""
    tmp = tmp_path_factory.mktemp("source")
    trainer = Trainer(config(tmp, corpus, "src", 4), log=lambda *_: None)
    trainer.fit()
    return f"{tmp}/src", weights(trainer), trainer.cfg.model


def source_loss(source_run, batch) -> float:
    """The source's own loss on `batch`, evaluated from its checkpoint (not through init_from)."""
    from pretrain.generate import load_for_inference

    model, *_ = load_for_inference(source_run, log=lambda *_: None, need=())
    with torch.no_grad():
        return float(model(batch, EVAL)[0])


def test_a_run_starts_from_the_source_weights_with_a_fresh_optimizer(tmp_path, corpus, source, monkeypatch):
    src_run, src_weights, _ = source
    monkeypatch.chdir(os.path.dirname(src_run))  # a relative init_from is stored absolute
    lines = []
    trainer = Trainer(config(tmp_path, corpus, "run", 2, **{"checkpoint.init_from": "src"}), log=lines.append)
    batch = next(trainer._loader())
    trainer._resume()
    assert_same(weights(trainer), src_weights)
    assert trainer.engine.get_state()[1]["state"] == {}  # no AdamW moments (the source's checkpoint has them)
    assert (trainer.step, trainer.consumed) == (0, 0)

    lines.clear()
    trainer.fit()
    said = [line for line in lines if "checkpoint.init_from" in line]
    assert said == [f"initial weights from {src_run}/checkpoints/step_00000004 (checkpoint.init_from); "
                    "optimizer, step and data order start fresh"]
    assert step_losses(f"{tmp_path}/run")[1] == pytest.approx(source_loss(src_run, batch), rel=1e-6, abs=0)
    assert f"init_from: {src_run}\n" in (tmp_path / "run" / "config.yaml").read_text()


def test_what_cannot_be_loaded_is_refused_in_validate(tmp_path, corpus, source):
    src_run = source[0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text("{not json")
    truncated = shutil.copytree(f"{src_run}/checkpoints/step_00000004", tmp_path / "truncated")
    with open(truncated / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    cases = [
        ({"model.d_model": 48}, src_run, f"checkpoint.init_from '{src_run}': the source has embed.weight of shape "
                                         "(64, 32), this run's model has (64, 48)"),
        ({"model.arch": "test_looped"}, src_run, f"checkpoint.init_from '{src_run}' holds model.arch 'baseline', "
                                                 "and model.arch 'test_looped' has no conversion"),
        ({"model.arch": "test_corrected", "model.n_heads": 2}, src_run,
         "model.arch 'baseline' cannot be converted to 'test_corrected' (model.n_heads 2 differs from the source's 4)"),
        ({}, f"{tmp_path}/nowhere", f"checkpoint.init_from '{tmp_path}/nowhere' does not exist"),
        ({}, str(tmp_path), "is neither a checkpoint directory nor a run directory with a complete checkpoint"),
        ({}, str(broken), f"checkpoint.init_from '{broken}' cannot be used: checkpoint {broken} has an unreadable"),
        ({}, str(truncated), f"checkpoint.init_from '{truncated}' cannot be used: checkpoint {truncated} is corrupt "
                             "(data file __0_0.distcp is truncated"),
    ]
    for fields, given, words in cases:
        with pytest.raises(ConfigError) as e:
            config(tmp_path, corpus, "run", 2, **{**fields, "checkpoint.init_from": given})
        assert words in one_line(e), (fields, given)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_a_run_with_its_own_checkpoint_resumes_it(tmp_path, corpus, source):
    src = shutil.copytree(source[0], tmp_path / "src")
    init = {"checkpoint.init_from": str(src)}
    Trainer(config(tmp_path, corpus, "whole", 4, **init), log=lambda *_: None).fit()
    Trainer(config(tmp_path, corpus, "run", 2, **init), log=lambda *_: None).fit()  # killed after step 2
    shutil.rmtree(src)  # not needed any more: the run resumes its own checkpoint
    lines = []
    Trainer(load_config(str(tmp_path / "run"), ["train.max_steps=4"]), log=lines.append).fit()
    assert f"resumed from {tmp_path}/run/checkpoints/step_00000002: step 2, 16 samples consumed (checkpoint." \
           f"init_from {src} is not read: the run has its own checkpoint)" in lines
    whole, resumed = step_losses(tmp_path / "whole"), step_losses(tmp_path / "run")
    assert sorted(resumed) == [1, 2, 3, 4] and resumed == whole


def test_a_conversion_gets_the_source_and_its_result_is_the_start(tmp_path, corpus, source):
    src_run, src_weights, src_model = source
    CALLS.clear()
    lines = []
    trainer = Trainer(config(tmp_path, corpus, "run", 2, **{"model.arch": "test_corrected",
                                                             "checkpoint.init_from": src_run}), log=lines.append)
    batch = next(trainer._loader())
    trainer._resume()
    (checked, _), ((arch, cfg, state, target), returned) = CALLS
    assert all(v.is_meta for v in checked[2].values())  # validate() converted shapes only
    assert arch == "baseline" and asdict(cfg) == asdict(src_model) and target is trainer.cfg.model
    assert_same(state, src_weights)
    assert_same(weights(trainer), returned)
    assert not torch.equal(returned["blocks.0.correction.up.weight"], Corrected(trainer.cfg.model).state_dict()[
        "blocks.0.correction.up.weight"])  # not the new model's own initialisation
    assert [line for line in lines if "checkpoint.init_from" in line] == [
        f"initial weights from {src_run}/checkpoints/step_00000004 (checkpoint.init_from, converted from model.arch "
        "'baseline' to 'test_corrected' by the registry's convert); optimizer, step and data order start fresh"]
    trainer.fit()  # the correction's output layer is zero: the converted model computes the source's function
    assert step_losses(f"{tmp_path}/run")[1] == pytest.approx(source_loss(src_run, batch), rel=1e-6, abs=0)


def test_init_from_is_relocated_with_the_run(tmp_path, source):
    from pretrain.runs import make_absolute, relocate

    proj = tmp_path / "proj"
    shutil.copytree(source[0], proj / "src")
    (proj / "runs" / "r").mkdir(parents=True)
    cfg = load_config("baseline/tiny", [f"train.run_dir={proj}/runs/r", f"checkpoint.init_from={proj}/src"],
                      check_data=False)
    make_absolute(cfg)
    shutil.move(proj, tmp_path / "moved")
    lines = []
    relocate(cfg, str(tmp_path / "moved" / "runs" / "r"), log=lines.append)
    assert cfg.checkpoint.init_from == str(tmp_path / "moved" / "src")
    assert lines == [f"checkpoint.init_from: {proj}/src is now found at {tmp_path}/moved/src"]


LAYOUTS = {"tp2": ["parallel.tp=2"]}
if importlib.util.find_spec("deepspeed"):  # partitioned parameters: another way into the model
    LAYOUTS["zero3"] = ["parallel.data_parallel=deepspeed", "parallel.zero_stage=3"]


def _layouts_body(rank, world_size, tmp, corpus, src_run):
    partition_everything_under_zero3()
    out = {}
    for layout, extra in LAYOUTS.items():
        for arch in ("baseline", "test_corrected"):
            cfg = config(tmp, corpus, f"{layout}-{arch}", 2, "train.compile=false", "train.micro_batch_seqs=4",
                         *extra, **{"model.arch": arch, "checkpoint.init_from": src_run})
            trainer = Trainer(cfg, log=lambda *_: None)
            trainer._resume()
            out[layout, arch] = {k: v.numpy() for k, v in weights(trainer).items()}
    return out


def test_tp2_and_zero3_start_from_the_weights_one_process_does(tmp_path, corpus, source):
    pytest.importorskip("megatron.core", reason="tensor parallelism needs megatron-core")
    src_run, src_weights, src_model = source
    target = CorrectedConfig(**{**asdict(src_model), "arch": "test_corrected"})
    expected = {"baseline": src_weights, "test_corrected": convert("baseline", src_model, src_weights, target)}
    results = run_ranks(_layouts_body, 2, args=(str(tmp_path), corpus, src_run), env={"DS_ACCELERATOR": "cpu"},
                        timeout=600)
    for ranks in results:
        assert sorted(ranks) == sorted((layout, arch) for layout in LAYOUTS for arch in expected)
        for (layout, arch), got in ranks.items():
            assert sorted(got) == sorted(expected[arch]), (layout, arch)
            for k, v in expected[arch].items():
                np.testing.assert_array_equal(got[k], v.numpy(), err_msg=f"{layout} {arch}: {k}")
