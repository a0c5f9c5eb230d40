"""Checkpoint integrity: every file's checksum is recorded at save and verified at load; a flipped
byte in the tensor data is named and the previous checkpoint is used instead; checkpoints from
before checksums still load, with a line; `pretrain eval`/`generate` name the bad file."""
import json
import os

import pytest
import torch

from distributed import run_ranks
from pretrain.checkpoint import (CHECKSUM, META_FILE, CheckpointError, CorruptCheckpoint, file_checksum,
                                 latest_checkpoint, load_checkpoint, load_latest, save_checkpoint)
from test_checkpoint import META, assert_same_model, tiny, train_step, trained


def flip_byte_in_tensor_data(ckpt: str) -> str:
    """Flip one bit in the middle of the largest DCP data file; returns the file's name."""
    name = max((n for n in os.listdir(ckpt) if n.endswith(".distcp")), key=lambda n: os.path.getsize(f"{ckpt}/{n}"))
    with open(os.path.join(ckpt, name), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(ckpt, name)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return name


def saved_pair(tmp_path):
    """Checkpoints at steps 1 and 2 of one run; returns (run_dir, the model's state at step 1)."""
    model, opt = trained(steps=1)
    save_checkpoint(str(tmp_path), 1, model, opt, META)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, opt, 7)
    save_checkpoint(str(tmp_path), 2, model, opt, META)
    return str(tmp_path), first


def test_every_file_gets_a_checksum_that_matches(tmp_path):
    model, opt = trained()
    path = save_checkpoint(str(tmp_path), 3, model, opt, META)
    with open(os.path.join(path, META_FILE)) as f:
        record = json.load(f)["checksums"]
    assert record["algorithm"] == CHECKSUM
    on_disk = sorted(n for n in os.listdir(path) if n != META_FILE)
    assert sorted(record["files"]) == on_disk and ".metadata" in on_disk and "optim.json" in on_disk
    assert all(file_checksum(os.path.join(path, n)) == h for n, h in record["files"].items())


def test_a_flipped_byte_is_named_and_the_previous_checkpoint_is_used(tmp_path):
    run_dir, first = saved_pair(tmp_path)
    newest = latest_checkpoint(run_dir)
    bad = flip_byte_in_tensor_data(newest)
    assert latest_checkpoint(run_dir, log=pytest.fail) == newest  # the cheap check cannot see a bit flip

    fresh, fresh_opt = tiny(seed=5)
    with pytest.raises(CorruptCheckpoint, match=f"step_00000002 is corrupt \\({bad} does not match the checksum"):
        load_checkpoint(newest, fresh, fresh_opt)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # refused before loading

    logged = []
    path, meta = load_latest(run_dir, fresh, fresh_opt, log=logged.append)
    assert path.endswith("step_00000001") and meta["step"] == 1
    assert logged == [f"checkpoint step_00000002 is corrupt ({bad} does not match the checksum recorded when it "
                      "was saved); falling back to step_00000001"]
    assert all(torch.equal(first[k], v) for k, v in fresh.state_dict().items())


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    run_dir, _ = saved_pair(tmp_path)
    for step in (1, 2):
        flip_byte_in_tensor_data(os.path.join(run_dir, "checkpoints", f"step_{step:08d}"))
    with pytest.raises(CorruptCheckpoint, match="no older complete checkpoint to fall back to .*checkpoint.verify=false"):
        load_latest(run_dir, *tiny(seed=1), log=lambda _: None)


def test_verification_off_loads_without_reading_checksums(tmp_path):
    model, opt = trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, META, checksums=False)
    with open(os.path.join(path, META_FILE)) as f:
        assert "checksums" not in json.load(f)
    fresh, fresh_opt = tiny(seed=1)
    load_checkpoint(path, fresh, fresh_opt, verify=False, log=pytest.fail)
    assert_same_model(model, fresh)


def test_checkpoints_from_before_checksums_load_with_a_line(tmp_path):
    model, opt = trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, META)
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    del meta["checksums"]  # exactly what the previous version wrote
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f)
    logged = []
    fresh, fresh_opt = tiny(seed=1)
    load_checkpoint(path, fresh, fresh_opt, log=logged.append)
    assert_same_model(model, fresh)
    assert len(logged) == 1 and "carries no checksums" in logged[0] and "loaded unverified" in logged[0]


def test_a_missing_file_and_an_unknown_algorithm_are_named(tmp_path):
    model, opt = trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, META)
    os.remove(os.path.join(path, "optim.json"))
    with pytest.raises(CheckpointError, match="is incomplete \\(file optim.json is missing\\)"):
        load_checkpoint(path, *tiny(seed=1))
    path = save_checkpoint(str(tmp_path), 2, model, opt, META)
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    meta["checksums"]["algorithm"] = "md4"
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match="has checksums of an unknown algorithm 'md4'"):
        load_checkpoint(path, *tiny(seed=1))


def _two_rank_save_then_corrupt(rank, world, root):
    """Both ranks save one checkpoint (each hashes its own DCP files); rank 0 flips a byte of rank 1's
    file; both then verify collectively and must agree on the same error."""
    import torch.distributed as dist

    model, opt = trained()
    path = save_checkpoint(root, 1, model, opt, META)
    with open(os.path.join(path, META_FILE)) as f:
        names = sorted(json.load(f)["checksums"]["files"])
    ok = load_checkpoint(path, *tiny(seed=1), restore_rng=False, log=lambda _: None)["step"]
    dist.barrier()
    if rank == 0:
        target = os.path.join(path, "__1_0.distcp")
        if os.path.getsize(target):
            with open(target, "r+b") as f:
                f.write(bytes([f.read(1)[0] ^ 1]))
    dist.barrier()
    try:
        load_checkpoint(path, *tiny(seed=1), restore_rng=False, log=lambda _: None)
        error = None
    except CorruptCheckpoint as e:
        error = str(e)
    return names, ok, error


def test_two_ranks_record_and_verify_every_file(tmp_path):
    results = run_ranks(_two_rank_save_then_corrupt, world_size=2, args=(str(tmp_path),))
    (names, ok, error), other = results[0], results[1]
    assert other == results[0]  # both ranks saw the same manifest and reached the same verdict
    assert ok == 1 and {"__0_0.distcp", "__1_0.distcp", ".metadata", "optim.json"} <= set(names)
    assert error is not None and "__1_0.distcp does not match the checksum" in error


def test_eval_and_generate_name_the_bad_file(tmp_path, monkeypatch, capsys):
    from pretrain.cli import main
    from test_relocation import RELATIVE, make_project, train

    proj = make_project(tmp_path / "proj")
    train(monkeypatch, proj, "baseline/tiny", *RELATIVE)  # checkpoints at steps 2 and 4
    newest = str(proj / "runs" / "r" / "checkpoints" / "step_00000004")
    bad = flip_byte_in_tensor_data(newest)
    capsys.readouterr()
    assert main(["eval", "runs/r", "--json"]) == 0  # a run directory: the previous checkpoint, said
    out = capsys.readouterr().out
    assert f"checkpoint step_00000004 is corrupt ({bad} does not match the checksum" in out
    assert "falling back to step_00000002" in out
    for verb in ("eval", "generate"):  # a checkpoint directory: an error naming the file
        assert main([verb, newest]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"checkpoint {newest} is corrupt ({bad} does not match" in err
