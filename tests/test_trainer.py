"""The training loop end to end on CPU: golden loss curve, metrics, evaluation, generation, and what
bad input does (exact resume after SIGKILL is a registry-wide test: tests/test_registry.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pretrain.config import load_config
from pretrain.metrics import read_metrics
from pretrain.trainer import Trainer
from trainer_helpers import tiny_overrides, write_markov_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The first 20 training losses of the tiny run of `tiny_overrides` (fp32, 1 thread, compile off).
# Exact equality holds on the machine that recorded them; another CPU may pick other SIMD kernels
# for the same matmuls, so the comparison allows 1e-6 relative.
# Re-recorded when the embedding stopped drawing its initial weights twice (one draw, as under TP).
GOLDEN = [4.155577659606934, 4.142746925354004, 4.09661865234375, 4.067733287811279, 4.018078804016113,
          3.9807348251342773, 3.9345738887786865, 3.916473150253296, 3.8778438568115234, 3.84094500541687,
          3.7928566932678223, 3.7969672679901123, 3.729389190673828, 3.728614568710327, 3.7046189308166504,
          3.702509880065918, 3.615403652191162, 3.6407270431518555, 3.617032527923584, 3.5899667739868164]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pretrain.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}


def test_golden_loss_curve(tmp_path, corpus):
    threads = torch.get_num_threads()
    try:
        record = Trainer(load_config("baseline/tiny", tiny_overrides(tmp_path, corpus)), log=lambda *_: None).fit()
    finally:
        torch.set_num_threads(threads)
    got = [losses(tmp_path / "run")[s] for s in range(1, 21)]
    assert got == pytest.approx(GOLDEN, rel=1e-6)
    assert record["step"] == 20 and record["val_loss"] < got[0]


def test_metrics_records_have_the_stable_keys(tmp_path, corpus):
    Trainer(load_config("baseline/tiny", tiny_overrides(tmp_path, corpus, **{"train.log_every": 4})),
            log=lambda *_: None).fit()
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [4, 8, 10, 12, 16, 20]  # log steps plus evaluation steps
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "mfu", "time_split", "eta_s"} <= set(r)
    assert [("val_loss" in r) for r in records] == [False, False, True, False, False, True]
    assert os.path.isfile(tmp_path / "run" / "config.yaml")


def test_diagnostics_and_the_step_context(tmp_path, corpus):
    """test_looped's diagnostics: a loss copy must be reduced exactly like the loss (micro batches of
    unequal token counts included), and a draw from ctx.generator() must be the step's own draw."""
    import looped_model  # noqa: F401
    from pretrain.models.base import StepContext

    lines = []
    over = tiny_overrides(tmp_path, corpus, **{"model.arch": "test_looped", "train.max_steps": 4,
                                               "train.eval_every": 2, "data.mask_cross_document": "true"})
    Trainer(load_config("baseline/tiny", over), log=lines.append).fit()
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["loss_copy"] == pytest.approx(r["loss"], rel=1e-6)
        want = torch.rand((), generator=StepContext.for_step(0, r["step"] - 1).generator()).item()
        assert r["draw"] == pytest.approx(want, rel=1e-6)
        assert ("val_loss_copy" in r) == ("val_loss" in r) and "val_draw" not in r  # eval has no draw
        if "val_loss" in r:
            assert r["val_loss_copy"] == pytest.approx(r["val_loss"], rel=1e-9)
    assert sum(f"| draw {records[0]['draw']:.4g} |" in ln for ln in lines) == 1  # on the progress line
    assert [ln for ln in lines if ln.startswith("kernels: ")] == ["kernels: attention sdpa, lm_loss reference, rms_norm torch"]  # once


def test_generate_and_eval_from_the_run(tmp_path, corpus):
    Trainer(load_config("baseline/tiny", tiny_overrides(tmp_path, corpus)), log=lambda *_: None).fit()
    out = run_cli("eval", str(tmp_path / "run"), "--json", "--unigram-entropy")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["val_loss"] > 0 and result["unigram_entropy"] > 0
    gen = run_cli("generate", str(tmp_path / "run"), "--prompt", "x")
    assert gen.returncode == 2 and "no tokenizer was saved" in gen.stderr


def test_vocabulary_overflow_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match="holds token id 63, beyond model.vocab_size 32"):
        Trainer(load_config("baseline/tiny", tiny_overrides(tmp_path, corpus, **{"model.vocab_size": 32})))


def test_nan_loss_stops_with_a_diagnostic(tmp_path, corpus):
    cfg = load_config("baseline/tiny", tiny_overrides(tmp_path, corpus, **{"checkpoint.every": 2}))
    trainer = Trainer(cfg, log=lambda *_: None)
    original = trainer.model.forward
    calls = {"n": 0}

    def poisoned(batch, ctx):
        calls["n"] += 1
        loss, diag = original(batch, ctx)
        return (loss * float("nan") if calls["n"] > 8 else loss), diag

    trainer.engine.forward = poisoned
    from pretrain.trainer import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match="step 5: non-finite loss and grad norm .* the last checkpoint is intact"):
        trainer.fit()
    from pretrain.checkpoint import latest_checkpoint

    assert latest_checkpoint(str(tmp_path / "run")).endswith("step_00000004")


def test_wandb_logs_offline_without_a_network(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb", reason="needs the wandb package (the test extra installs it)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 4, "log.wandb": "true", "checkpoint.every": 0,
                                               "schedule.warmup_steps": 1})
    Trainer(load_config("baseline/tiny", over), log=lambda *_: None).fit()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_plot_writes_a_png(tmp_path, corpus):
    pytest.importorskip("matplotlib", reason="pretrain plot needs matplotlib (the test extra installs it)")
    Trainer(load_config("baseline/tiny", tiny_overrides(tmp_path, corpus, **{"train.max_steps": 10})),
            log=lambda *_: None).fit()
    out = run_cli("plot", str(tmp_path / "run"), "--output", str(tmp_path / "loss.png"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_training_path_runs_on_cpu(tmp_path, corpus):
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 6, "train.precision": "bf16",
                                               "schedule.warmup_steps": 1})
    trainer = Trainer(load_config("baseline/tiny", over), log=lambda *_: None)
    assert trainer.amp_dtype == torch.bfloat16
    record = trainer.fit()
    got = losses(tmp_path / "run")
    assert all(v == v and v < 10 for v in got.values()) and record["val_loss"] < got[1] + 0.5
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_fp64_training_keeps_every_digit_resumes_and_evaluates(tmp_path, corpus):
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 4, "train.precision": "fp64",
                                               "schedule.warmup_steps": 1})
    trainer = Trainer(load_config("baseline/tiny", over), log=lambda *_: None)
    assert trainer.amp_dtype is None and all(p.dtype == torch.float64 for p in trainer.model.parameters())
    trainer.fit()
    got = losses(tmp_path / "run")
    # logged in float64: an fp32 sum on the way would leave values a float32 holds exactly
    assert any(torch.tensor(v, dtype=torch.float32).item() != v for v in got.values())
    resumed = Trainer(load_config("baseline/tiny", over + ["train.max_steps=6"]), log=lambda *_: None)
    resumed.fit()
    assert resumed.step == 6 and all(p.dtype == torch.float64 for p in resumed.model.parameters())
    out = run_cli("eval", str(tmp_path / "run"), "--json")
    assert out.returncode == 0, out.stderr
    assert 0 < json.loads(out.stdout)["val_loss"] < 10


def test_starting_over_never_deletes_a_previous_run(tmp_path, corpus):
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 5, "schedule.warmup_steps": 1})
    Trainer(load_config("baseline/tiny", over), log=lambda *_: None).fit()
    before = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    with pytest.raises(ValueError, match="already holds checkpoints .* checkpoint.resume=false"):
        Trainer(load_config("baseline/tiny", over + ["checkpoint.resume=false"]), log=lambda *_: None).fit()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == before


def test_configs_ship_in_the_wheel(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "No module named" in out.stderr:
        pytest.skip(f"cannot build a wheel here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    import zipfile

    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "configs/baseline/tiny.yaml" in names and "configs/baseline/xl.yaml" in names
    assert "pretrain/cli.py" in names and "kernels/attention/reference.py" in names


def test_nan_policy_skip_drops_the_step_and_goes_on(tmp_path, corpus):
    over = tiny_overrides(tmp_path, corpus, **{"train.nan_policy": "skip", "train.max_steps": 6,
                                               "schedule.warmup_steps": 1})
    lines = []
    trainer = Trainer(load_config("baseline/tiny", over), log=lines.append)
    original = trainer.model.forward
    calls = {"n": 0}

    def poisoned(batch, ctx):
        calls["n"] += 1
        loss, diag = original(batch, ctx)
        return (loss * float("nan") if calls["n"] == 5 else loss), diag  # a micro batch of step 3

    trainer.engine.forward = poisoned
    before = [p.detach().clone() for p in trainer.model.parameters()]
    record = trainer.fit()
    assert any(ln.startswith("step 3: non-finite loss and grad norm") and "update skipped; data: samples 16-23"
               in ln for ln in lines)
    assert record["step"] == 6 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    again = []
    Trainer(load_config("baseline/tiny", over), log=again.append).fit()  # a finished run says so
    assert any("already complete at step 6" in ln for ln in again)
