"""Checkpoints: exact round trip and resume, RNG, tied weights, retention, `latest` and its fallbacks,
crashed-save leftovers, one-line errors for mismatched or damaged checkpoints."""
import json
import os

import pytest
import torch

from pretrain.checkpoint import (SCHEMA_VERSION, CheckpointError, latest_checkpoint, list_checkpoints,
                                 load_checkpoint, save_checkpoint)
from pretrain.models import get_arch
from pretrain.optim import OptimConfig, build_optimizer

SPEC = get_arch("baseline")
META = {"consumed_samples": 64, "tokenizer": "tok.json", "config": {"model": {"arch": "baseline", "d_model": 32}}}


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = SPEC.config_cls(**{**dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=64), **kw})
    model = SPEC.build(cfg)
    return model, build_optimizer(model, OptimConfig(lr=1e-2))


def train_step(model, optimizer, seed):
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(16).expand(2, 16)
    model.head.loss(model.hidden(tokens[:, :-1], positions), tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trained(seed=0, steps=2):
    model, optimizer = tiny(seed)
    for s in range(steps):
        train_step(model, optimizer, s)
    return model, optimizer


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def assert_same_optimizer(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)


def one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_round_trip_is_exact_and_resume_is_bit_identical(tmp_path):
    model, optimizer = trained()
    path = save_checkpoint(str(tmp_path), 2, model, optimizer, META)
    assert path == str(tmp_path / "checkpoints" / "step_00000002")
    after_save = torch.rand(8)  # what the original run draws next

    fresh, fresh_opt = tiny(seed=1)
    meta = load_checkpoint(path, fresh, fresh_opt, expect_arch="baseline")
    assert torch.equal(torch.rand(8), after_save)  # RNG restored
    assert meta.pop("checksums")["algorithm"] == "xxh3_128"  # (tests/test_checkpoint_integrity.py)
    assert meta == {**META, "schema_version": SCHEMA_VERSION, "step": 2}
    assert fresh.head.weight is fresh.embed.weight  # still tied
    assert_same_model(model, fresh)
    assert_same_optimizer(optimizer, fresh_opt)
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.95)

    train_step(model, optimizer, 7)
    train_step(fresh, fresh_opt, 7)
    assert_same_model(model, fresh)
    assert_same_optimizer(optimizer, fresh_opt)


def test_weights_only_load_leaves_rng_alone(tmp_path):
    model, optimizer = trained()
    path = save_checkpoint(str(tmp_path), 2, model, optimizer, META)
    fresh, _ = tiny(seed=1)
    rng = torch.get_rng_state()
    load_checkpoint(path, fresh, restore_rng=False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_model(model, fresh)
    assert fresh.head.weight is fresh.embed.weight


def test_save_before_the_first_step_changes_nothing(tmp_path):
    model, optimizer = tiny()
    path = save_checkpoint(str(tmp_path), 0, model, optimizer, META)
    assert not optimizer.state  # DCP's state init (a zero-lr step) was undone
    fresh, fresh_opt = tiny(seed=1)
    load_checkpoint(path, fresh, fresh_opt)
    assert not fresh_opt.state
    train_step(model, optimizer, 0)
    train_step(fresh, fresh_opt, 0)
    assert_same_model(model, fresh)
    assert_same_optimizer(optimizer, fresh_opt)


def test_retention_and_latest(tmp_path):
    model, optimizer = trained(steps=1)
    for step in range(1, 8):
        save_checkpoint(str(tmp_path), step, model, optimizer, META, keep_last=2, keep_every=3)
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / f"step_{step:08d}")
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 6, 7]
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", "step_00000006", "step_00000007"]
    assert (root / "latest").read_text().strip() == "step_00000007"
    (root / "latest").write_text("step_00000006\n")  # pointed back on purpose (a rollback): honoured
    assert latest_checkpoint(str(tmp_path), log=pytest.fail) == str(root / "step_00000006")


def test_no_complete_checkpoint_is_none(tmp_path):
    logged = []
    assert latest_checkpoint(str(tmp_path), log=logged.append) is None
    assert list_checkpoints(str(tmp_path)) == [] and logged == []
    model, optimizer = trained(steps=1)
    path = save_checkpoint(str(tmp_path), 1, model, optimizer, META)
    os.remove(os.path.join(path, "meta.json"))
    assert latest_checkpoint(str(tmp_path), log=logged.append) is None
    assert logged == ["checkpoint step_00000001 is incomplete (no meta.json); no complete checkpoint to fall back to"]


def test_tensor_learning_rate_round_trips(tmp_path):
    model, optimizer = tiny()
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.01)
    train_step(model, optimizer, 0)
    path = save_checkpoint(str(tmp_path), 1, model, optimizer, META)
    fresh, fresh_opt = tiny(seed=1)
    load_checkpoint(path, fresh, fresh_opt)
    assert all(isinstance(g["lr"], torch.Tensor) and g["lr"].item() == torch.tensor(0.01).item()
               for g in fresh_opt.param_groups)
    assert_same_optimizer(optimizer, fresh_opt)


def _truncate_data(path):
    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(os.path.join(path, data), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, data)) // 2)


DAMAGE = {  # how the newest checkpoint (step 2) or `latest` is broken -> expected log text
    "no meta.json": (lambda root: os.remove(root / "step_00000002" / "meta.json"),
                     "checkpoint step_00000002 is incomplete (no meta.json); falling back to step_00000001"),
    "garbage meta.json": (lambda root: (root / "step_00000002" / "meta.json").write_text("{not json"),
                          "checkpoint step_00000002 has an unreadable meta.json"),
    "no .metadata": (lambda root: os.remove(root / "step_00000002" / ".metadata"),
                     "checkpoint step_00000002 is incomplete (no DCP .metadata file)"),
    "truncated data": (lambda root: _truncate_data(root / "step_00000002"),
                       "checkpoint step_00000002 is corrupt (data file __0_0.distcp is truncated"),
    "latest -> missing": (lambda root: (root / "latest").write_text("step_00000009\n"),
                          "step_00000009 named by checkpoints/latest is missing; falling back to step_00000002"),
    "garbage latest": (lambda root: (root / "latest").write_bytes(b"\xff\x00../etc"),
                       "falling back to step_00000002"),
    "no latest": (lambda root: os.remove(root / "latest"),
                  "checkpoints/latest is missing; falling back to step_00000002"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_broken_newest_falls_back_with_one_log_line(tmp_path, damage):
    model, optimizer = trained(steps=1)
    for step in (1, 2):
        save_checkpoint(str(tmp_path), step, model, optimizer, META)
    root = tmp_path / "checkpoints"
    breaker, expected = DAMAGE[damage]
    breaker(root)
    logged = []
    found = latest_checkpoint(str(tmp_path), log=logged.append)
    assert len(logged) == 1 and expected in logged[0], logged
    assert "\n" not in logged[0]
    newest_ok = damage.startswith(("latest", "garbage latest", "no latest"))
    assert found == str(root / ("step_00000002" if newest_ok else "step_00000001"))
    load_checkpoint(found, tiny(seed=1)[0])


@pytest.mark.parametrize("damage", ["no meta.json", "garbage meta.json", "no .metadata", "truncated data"])
def test_loading_a_broken_checkpoint_is_a_one_line_error(tmp_path, damage):
    model, optimizer = trained(steps=1)
    path = save_checkpoint(str(tmp_path), 2, model, optimizer, META)
    DAMAGE[damage][0](tmp_path / "checkpoints")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, *tiny(seed=1))
    assert one_line(e).startswith(f"checkpoint {path} ")


def test_damaged_data_bytes_are_a_one_line_error(tmp_path):
    model, optimizer = trained(steps=1)
    path = save_checkpoint(str(tmp_path), 2, model, optimizer, META)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:  # the first tensor record's header
        f.seek(64)
        f.write(b"\x00" * 64)
    with pytest.raises(CheckpointError) as e:  # the checksum sees it first
        load_checkpoint(path, *tiny(seed=1))
    assert one_line(e).startswith(f"checkpoint {path} is corrupt (__0_0.distcp does not match the checksum")
    with pytest.raises(CheckpointError) as e:  # unverified, DCP's own failure is still one line
        load_checkpoint(path, *tiny(seed=1), verify=False)
    assert one_line(e).startswith(f"checkpoint {path} could not be loaded")


def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    dead = root / ".step_00000005.tmp-1073741824"  # above any pid_max: never a live process
    alive = root / f".step_00000005.tmp-{os.getppid()}"  # a save in progress elsewhere
    for d in (dead, alive):
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"partial")
    (root / ".latest.tmp-1073741824").write_text("step_0000")
    model, optimizer = trained(steps=1)
    save_checkpoint(str(tmp_path), 6, model, optimizer, META)
    assert sorted(os.listdir(root)) == sorted(["latest", "step_00000006", alive.name])


def test_wrong_arch_and_wrong_shape_are_one_line_errors(tmp_path):
    model, optimizer = trained(steps=1)
    path = save_checkpoint(str(tmp_path), 1, model, optimizer, META)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model, expect_arch="mamba")
    assert one_line(e) == f"checkpoint {path} holds model.arch 'baseline', the config asks for 'mamba'"
    for kw, words in [({"d_model": 48}, "model.embed.weight of shape (97, 32), the model has (97, 48)"),
                      ({"n_layers": 3}, "has no tensor model.blocks.2."),
                      ({"n_layers": 1}, "has model.blocks.1.")]:
        other, other_opt = tiny(**kw)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path, other, other_opt)
        assert words in one_line(e), kw
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())  # untouched
        assert not other_opt.state


def test_newer_schema_and_missing_optimizer_state_are_refused(tmp_path):
    model, optimizer = trained(steps=1)
    path = save_checkpoint(str(tmp_path), 1, model, None, META)  # weights only
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model, optimizer)
    assert "holds no optimizer state" in one_line(e)
    meta_file = os.path.join(path, "meta.json")
    meta = json.load(open(meta_file))
    json.dump({**meta, "schema_version": SCHEMA_VERSION + 1}, open(meta_file, "w"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model)
    assert f"schema_version {SCHEMA_VERSION + 1}, newer than this code's {SCHEMA_VERSION}" in one_line(e)


def test_resaving_a_step_replaces_it(tmp_path):
    model, optimizer = trained(steps=1)
    save_checkpoint(str(tmp_path), 1, model, optimizer, META)
    save_checkpoint(str(tmp_path), 2, model, optimizer, {**META, "consumed_samples": 1})
    train_step(model, optimizer, 5)  # a resumed run reaches step 2 again, elsewhere
    path = save_checkpoint(str(tmp_path), 2, model, optimizer, {**META, "consumed_samples": 2})
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000002"]
    fresh, fresh_opt = tiny(seed=1)
    assert load_checkpoint(path, fresh, fresh_opt)["consumed_samples"] == 2
    assert_same_model(model, fresh)
    assert_same_optimizer(optimizer, fresh_opt)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained(steps=1)
    good = save_checkpoint(str(tmp_path), 1, model, optimizer, META)
    import pretrain.checkpoint as ckpt

    def crash(path, text):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_file", crash)
    for step in (1, 2):  # a re-save of the same step, and a new step
        with pytest.raises(OSError):
            save_checkpoint(str(tmp_path), step, model, optimizer, META)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000001"]
    assert latest_checkpoint(str(tmp_path), log=pytest.fail) == good


def _each_rank_keeps_its_gpus_rng(rank, world_size, root):
    """Two ranks, each with a GPU of its own (the CUDA RNG calls stood in for: this is a CPU), save and load."""
    from unittest import mock

    from pretrain import checkpoint
    from pretrain.checkpoint import load_checkpoint, save_checkpoint

    mine = torch.full((16,), rank + 1, dtype=torch.uint8)  # this rank's GPU generator, advanced its own way
    restored = []
    with mock.patch.object(checkpoint, "_has_cuda", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: world_size), \
            mock.patch.object(torch.cuda, "current_device", lambda: rank), \
            mock.patch.object(torch.cuda, "get_rng_state", lambda device="cuda": mine.clone()), \
            mock.patch.object(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state)):
        model, opt = trained()
        path = save_checkpoint(root, 1, model, opt, META)
        mine.zero_()  # the generator moved on; the load puts it back
        load_checkpoint(path, *tiny(seed=1), log=lambda _: None)
    return [r.tolist() for r in restored]


def test_each_rank_gets_its_own_gpus_rng_state_back(tmp_path):
    """DCP keeps one copy of a key that every rank saves: the CUDA RNG state is saved under each rank's key, so
    a resumed rank gets its own GPU's generator back, not another rank's view of it."""
    from distributed import run_ranks

    restored = run_ranks(_each_rank_keeps_its_gpus_rng, world_size=2, args=(str(tmp_path),))
    assert restored == [[[1] * 16], [[2] * 16]]
