"""Numerical faults survived (pretrain/bad_steps.py): a non-finite loss, a non-finite gradient and a
loss spike injected at known steps by the test architecture of tests/fault_model.py. A skipped step
leaves the optimizer state bit for bit as it was and the run goes on; too many in a row stop it in
one sentence naming the steps and their data positions, with the last checkpoint intact; skips are
counted in metrics.jsonl and on the progress line; every rank decides the same."""
import os
import subprocess
import sys

import pytest
import torch

import fault_model
from distributed import run_ranks
from pretrain.checkpoint import latest_checkpoint
from pretrain.config import load_config
from pretrain.metrics import read_metrics
from pretrain.run_config import ConfigError
from pretrain.trainer import Trainer
from trainer_helpers import tiny_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def faults():
    with fault_model.registered():
        yield


def overrides(tmp, corpus, **extra):
    values = {"model.arch": fault_model.NAME, "train.max_steps": 6, "train.eval_every": 0, "checkpoint.every": 0,
              "schedule.warmup_steps": 1, "train.compile": "false", "train.nan_policy": "skip", **extra}
    return tiny_overrides(tmp, corpus, **values)


def _snapshot(engine) -> dict:
    model_sd, optim_sd = engine.get_state()
    flat = {f"model.{k}": v.detach().clone() for k, v in model_sd.items()}
    for name, entry in (optim_sd or {}).get("state", {}).items():
        flat.update({f"optim.{name}.{k}": torch.as_tensor(v).detach().clone() for k, v in entry.items()})
    return flat


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def watch_steps(trainer) -> list:
    """Wrap the trainer's step-or-skip to record (step, skipped, model+optimizer state unchanged)."""
    seen, original = [], trainer._step_or_skip

    def watched(*args):
        before = _snapshot(trainer.engine)
        out = original(*args)
        seen.append((trainer.step + 1, out[1], _identical(before, _snapshot(trainer.engine))))
        return out

    trainer._step_or_skip = watched
    return seen


def train(tmp, corpus, lines=None, **extra):
    trainer = Trainer(load_config("baseline/tiny", overrides(tmp, corpus, **extra)),
                      log=(lines.append if lines is not None else lambda *_: None))
    seen = watch_steps(trainer)
    threads = torch.get_num_threads()
    try:
        record = trainer.fit()
    finally:
        torch.set_num_threads(threads)
    return trainer, record, seen


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("train.max_bad_steps", -1, "train.max_bad_steps must be >= 0"),
    ("train.skip_outlier_z", -2.0, "train.skip_outlier_z must be > 0"),
    ("train.skip_outlier_z", 0.0, "train.skip_outlier_z must be > 0"),
    ("train.skip_outlier_window", 1, "train.skip_outlier_window must be at least 2"),
])
def test_bad_settings_are_refused_in_one_sentence(tmp_path, corpus, field, value, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("baseline/tiny", tiny_overrides(tmp_path, corpus, **{field: value}))
    assert "\n" not in str(e.value) and str(e.value).count(". ") == 0


def test_bad_setting_through_the_cli_before_any_work(tmp_path, corpus):
    out = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny",
                          *tiny_overrides(tmp_path, corpus, **{"train.skip_outlier_z": -1})],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 2 and "train.skip_outlier_z must be > 0" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# -- one process -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["nan_loss_steps", "nan_grad_steps"])
def test_a_non_finite_step_is_skipped_and_touches_no_state(tmp_path, corpus, faults, fault):
    lines = []
    trainer, record, seen = train(tmp_path, corpus, lines, **{f"model.{fault}": "[3]"})
    assert record["step"] == 6
    assert [(s, skipped) for s, skipped, _ in seen] == [(s, s == 3) for s in range(1, 7)]
    assert all(same == skipped for _, skipped, same in seen)  # a skip changes nothing, a step changes something
    what = "non-finite loss (" if fault == "nan_loss_steps" else "non-finite grad norm ("
    skip_lines = [ln for ln in lines if "update skipped" in ln]
    assert len(skip_lines) == 1 and skip_lines[0].startswith(f"step 3: {what}")
    assert skip_lines[0].endswith("update skipped; data: samples 16-23 of markov")
    records = {r["step"]: r for r in read_metrics(str(tmp_path / "run"))}
    assert [records[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 0, 0, 0]
    assert records[6]["skipped_total"] == 1
    progress = [ln for ln in lines if ln.startswith("step 3/6")]
    assert progress and "| skipped 1 (run: 1)" in progress[0]
    # AdamW's own step count (bias correction) counts applied steps only
    _, optim_sd = trainer.engine.get_state()
    assert {float(e["step"]) for e in optim_sd["state"].values()} == {5.0}


def test_nan_policy_stop_stops_at_the_first_and_saves_nothing(tmp_path, corpus, faults):
    with pytest.raises(Exception, match=r"step 3: non-finite grad norm .* data: samples 16-23 of markov; stopped "
                                        r"\(train.nan_policy=stop\) without saving, the last checkpoint is intact"):
        train(tmp_path, corpus, **{"model.nan_grad_steps": "[3]", "train.nan_policy": "stop",
                                   "checkpoint.every": 2})
    assert latest_checkpoint(str(tmp_path / "run")).endswith("step_00000002")


def test_an_outlier_is_skipped_when_the_rule_is_on(tmp_path, corpus, faults):
    lines = []
    extra = {"model.spike_steps": "[7]", "train.max_steps": 8, "train.skip_outlier_z": 3.0,
             "train.skip_outlier_window": 4, "train.nan_policy": "stop"}
    _, _, seen = train(tmp_path, corpus, lines, **extra)
    assert [s for s, skipped, _ in seen if skipped] == [7] and all(same == skipped for _, skipped, same in seen)
    assert any(ln.startswith("step 7: loss ") and "is an outlier" in ln and "update skipped" in ln for ln in lines)
    # off by default: the same spike is applied
    _, _, seen = train(tmp_path / "off", corpus, **{**extra, "train.skip_outlier_z": "null"})
    assert not any(skipped for _, skipped, _ in seen)


def test_too_many_in_a_row_stop_through_the_cli(tmp_path, corpus):
    """The public CLI in a real process (with the test architecture registered before pretrain.cli.main)."""
    over = overrides(tmp_path, corpus, **{"model.nan_grad_steps": "[3,4,5]", "train.max_bad_steps": 2,
                                          "checkpoint.every": 2, "train.max_steps": 8})
    out = subprocess.run([sys.executable, os.path.join(TESTS, "fault_model.py"), "train", "baseline/tiny", *over],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    error = out.stderr.strip().splitlines()[-1]
    assert error == ("pretrain train: error: 3 steps in a row were skipped, more than train.max_bad_steps=2: "
                     "step 3 (samples 16-23 of markov), step 4 (samples 24-31 of markov), step 5 (samples 32-39 "
                     "of markov); the last was non-finite grad norm (loss " + error.split("(loss ")[-1])
    assert error.endswith("; stopped without saving, the last checkpoint is intact")
    # the checkpoint of step 4 holds step 2's weights (steps 3 and 4 were skipped); nothing after it
    assert latest_checkpoint(str(tmp_path / "run")).endswith("step_00000004")
    assert "step 3: non-finite grad norm" in out.stdout and "step 4/8" in out.stdout


def test_the_run_of_skips_survives_a_resume(tmp_path, corpus, faults):
    """The consecutive count is in the checkpoint: resumed after two skips, a third stops the run."""
    extra = {"model.nan_grad_steps": "[4,5,6]", "train.max_bad_steps": 2, "checkpoint.every": 5}
    train(tmp_path, corpus, **{**extra, "train.max_steps": 5})
    with pytest.raises(Exception, match=r"3 steps in a row were skipped.*step 4 .*step 5 .*step 6 "):
        train(tmp_path, corpus, **{**extra, "train.max_steps": 8})


# -- data-parallel ranks ---------------------------------------------------------------------------

def _rank_body(rank, world_size, tmp, corpus, extra):
    fault_model.register()
    from trainer_helpers import partition_everything_under_zero3

    if extra.get("parallel.data_parallel") == "deepspeed":
        partition_everything_under_zero3()
    over = overrides(tmp, corpus, **{"model.nan_grad_steps": "[3]", "model.fault_rank": 0, "train.max_steps": 4,
                                     **extra})
    lines = []
    trainer = Trainer(load_config("baseline/tiny", over), log=lines.append)
    seen = watch_steps(trainer)
    trainer.fit()
    return seen, [ln for ln in lines if "update skipped" in ln]


ENGINES = {
    "ddp": {},
    "megatron": {"parallel.data_parallel": "megatron"},
    "megatron_distopt": {"parallel.data_parallel": "megatron", "parallel.distributed_optimizer": "true"},
    "zero1": {"parallel.data_parallel": "deepspeed", "parallel.zero_stage": 1},
    "zero2": {"parallel.data_parallel": "deepspeed", "parallel.zero_stage": 2},
    "zero3": {"parallel.data_parallel": "deepspeed", "parallel.zero_stage": 3},
    "tp2": {"parallel.tp": 2},
}


@pytest.mark.parametrize("engine", [pytest.param(e, marks=[] if e == "ddp" else pytest.mark.slow) for e in ENGINES])
def test_every_rank_skips_the_same_step(tmp_path, corpus, engine):
    """A NaN gradient on rank 0 only: both ranks skip step 3, and their state is untouched by it."""
    extra = ENGINES[engine]
    results = run_ranks(_rank_body, 2, args=(str(tmp_path), corpus, extra), timeout=300)
    for seen, _ in results:
        assert [(s, skipped) for s, skipped, _ in seen] == [(1, False), (2, False), (3, True), (4, False)]
        assert all(same == skipped for _, skipped, same in seen)
    skips = results[0][1]  # rank 0 speaks (the others write their rank log)
    assert len(skips) == 1 and skips[0].startswith("step 3: non-finite grad norm")


def test_data_position_names_each_blended_dataset_and_its_samples():
    from types import SimpleNamespace

    from pretrain.bad_steps import data_position
    from pretrain.data.blend import BlendedDataset

    a, b = SimpleNamespace(name="web_text_document"), SimpleNamespace(name="code_text_document")
    blend = BlendedDataset([(3, a), (1, b)], block_size=8)  # per block of 8: 6 of a, 2 of b
    expected = {}
    for i in range(8, 16):
        d, k = blend.source(i)
        expected.setdefault(d, []).append(k)
    assert sorted(expected[0]) == list(range(6, 12)) and sorted(expected[1]) == [2, 3]
    assert data_position(blend, 8, 8) == ("samples 8-15 of the blend (web_text_document: 6-11; "
                                          "code_text_document: 2-3)")
    assert data_position(SimpleNamespace(name="markov"), 16, 8) == "samples 16-23 of markov"
