"""Exported folders: the registry-wide round trip, the standalone loader, and what export refuses.

Every registered architecture trains a few steps, is exported, and its folder (loaded with the
standalone loader) computes the run checkpoint's logits (fp32 to 1e-5) and greedy tokens; an
architecture that cannot be exported declares why in its registry entry and is refused with it.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import looped_model  # noqa: F401  (registers the test architectures)
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.export.loader import load_folder
from pretrain.export.writer import CONFIG_FILE, WEIGHTS_FILE, export
from pretrain.generate import generate, load_for_inference
from pretrain.models import all_archs, get_arch
from pretrain.trainer import Trainer
from test_registry import ROOT, run_overrides, tiny_config
from trainer_helpers import VOCAB, write_markov_corpus, write_word_tokenizer

ALL = [s.name for s in all_archs()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def train(tmp_path, corpus, arch="baseline", steps=4, **extra):
    config, over = tiny_config(arch)
    tok = write_word_tokenizer(tmp_path / "tok.json")
    values = {"train.max_steps": steps, "checkpoint.every": steps, **extra}
    threads = torch.get_num_threads()
    try:
        Trainer(load_config(config, over + run_overrides(tmp_path, corpus, tok, **values)), log=lambda *_: None).fit()
    finally:
        torch.set_num_threads(threads)
    return str(tmp_path / "run")


def quiet(*_):
    pass


TOKENS = torch.randint(5, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("arch", ALL)
def test_export_round_trip(arch, tmp_path, corpus):
    run = train(tmp_path, corpus, arch)
    spec = get_arch(arch)
    out = str(tmp_path / "exported")
    if spec.export_refusal:
        with pytest.raises(ValueError, match=spec.export_refusal[:30]):
            export(run, out, log=quiet)
        assert not os.path.exists(out)
        return
    export(run, out, log=quiet)
    model, _, _, _ = load_for_inference(run, log=quiet)
    loaded, lspec, cfg, tok = load_folder(out, log=quiet)
    assert lspec is spec and cfg.model == model.cfg and tok is not None
    with torch.no_grad():
        torch.testing.assert_close(spec.logits(loaded, TOKENS), spec.logits(model, TOKENS), rtol=0, atol=1e-5)
    prompt = TOKENS[:, :3].tolist()
    assert generate(loaded, spec, prompt, 8, temperature=0) == generate(model, spec, prompt, 8, temperature=0)
    files = set(os.listdir(out))
    assert {CONFIG_FILE, WEIGHTS_FILE, "generation_config.json", "README.md", "tok.json"} <= files
    card = open(os.path.join(out, "README.md")).read()
    assert f"`{arch}`" in card and "training tokens | 1,024 (4 steps)" in card and "Produced by" in card


def test_cli_export_then_eval_and_generate_from_the_folder(tmp_path, corpus, capsys):
    run = train(tmp_path, corpus, **{"train.eval_every": 4})
    out = str(tmp_path / "folder")
    assert main(["export", run, out]) == 0
    assert "exported baseline step 4" in capsys.readouterr().out
    config = json.load(open(os.path.join(out, CONFIG_FILE)))
    assert config["arch"] == "baseline" and config["aliases"] == {"head.weight": "embed.weight"}  # tied, stored once
    card = open(os.path.join(out, "README.md")).read()
    assert "final validation loss | " in card and "at step 4" in card
    for path in (run, out):  # the folder evaluates and samples like the run
        assert main(["eval", path, "--json", "--batches", "2"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert main(["generate", path, "--prompt", "t5 t9", "--max-tokens", "5", "--temperature", "0"]) == 0
        result["sample"] = capsys.readouterr().out
        if path == run:
            expected = result
    assert result == expected


@pytest.mark.parametrize("arch", ["baseline", "crt"])
def test_the_loader_needs_torch_and_safetensors_only(tmp_path, corpus, arch):
    run = train(tmp_path, corpus, arch)
    out = str(tmp_path / "folder")
    export(run, out, log=quiet)
    code = f"""
import sys
for name in ("megatron", "deepspeed", "transformer_engine", "apex"):
    sys.modules[name] = None  # importing any of them now fails
import torch
from pretrain.export import load_folder
from pretrain.generate import generate
model, spec, cfg, tok = load_folder({out!r})
print(generate(model, spec, [[5, 6, 7]], 4, temperature=0)[0])
assert not torch.distributed.is_initialized()
banned = [m for m in sys.modules if m.startswith(("torch.distributed.checkpoint", "megatron", "deepspeed"))
          and sys.modules[m] is not None]
assert not banned, banned
"""
    out_ = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out_.returncode == 0, out_.stderr
    assert len(json.loads(out_.stdout.strip())) == 4


def test_dtype_and_force(tmp_path, corpus):
    run = train(tmp_path, corpus)
    out = str(tmp_path / "folder")
    export(run, out, dtype="bfloat16", log=quiet)
    from safetensors import safe_open

    with safe_open(os.path.join(out, WEIGHTS_FILE), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="already exists; pass --force"):
        export(run, out, log=quiet)
    before = open(os.path.join(out, CONFIG_FILE)).read()
    assert json.loads(before)["dtype"] == "bfloat16"
    export(run, out, force=True, log=quiet)
    assert json.loads(open(os.path.join(out, CONFIG_FILE)).read())["dtype"] == "float32"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".folder")] == []  # no temporary left


def test_a_folder_of_an_fp64_run_loads_in_fp64_with_every_digit(tmp_path, corpus):
    """A numerical-check run's export keeps float64 weights; loading the folder keeps them float64 too, as
    loading its checkpoint does (pretrain generate/eval), instead of rounding them to float32."""
    from pretrain.generate import load_for_inference

    run = train(tmp_path, corpus, **{"train.precision": "fp64"})
    out = str(tmp_path / "folder")
    export(run, out, log=quiet)
    from_run, *_ = load_for_inference(run, log=quiet)
    from_folder, *_ = load_for_inference(out, log=quiet)
    assert {p.dtype for p in from_folder.parameters()} == {torch.float64}
    for (name, a), (_, b) in zip(from_run.state_dict().items(), from_folder.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_corrupt_checkpoint_is_refused_and_nothing_is_written(tmp_path, corpus):
    run = train(tmp_path, corpus)
    ckpt = os.path.join(run, "checkpoints", "step_00000004")
    data = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]
    with open(os.path.join(ckpt, data), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    out = str(tmp_path / "folder")
    with pytest.raises(Exception, match=f"{data} does not match the checksum"):
        export(ckpt, out, log=quiet)
    assert not os.path.exists(out)
    os.remove(os.path.join(ckpt, "meta.json"))  # half-written: no meta.json
    with pytest.raises(Exception, match="is incomplete"):
        export(ckpt, out, log=quiet)
    assert not os.path.exists(out) and [n for n in os.listdir(tmp_path) if n.startswith(".folder")] == []


def test_what_cannot_be_exported_is_refused_before_any_work(tmp_path, corpus, monkeypatch):
    import dataclasses

    from pretrain.models import registry

    run = train(tmp_path, corpus, **{"model.max_seq_len": 64})
    spec = get_arch("baseline")
    monkeypatch.setitem(registry._REGISTRY, "baseline", dataclasses.replace(spec, export_refusal="a test reason"))
    with pytest.raises(ValueError, match="model.arch 'baseline' cannot be exported: a test reason"):
        export(run, str(tmp_path / "out"), log=quiet)
    monkeypatch.undo()
    for out in (str(tmp_path), run, os.path.join(run, "checkpoints")):  # --force must not delete the source
        with pytest.raises(ValueError, match="contains the source|is inside the source"):
            export(run, out, force=True, log=quiet)
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_00000004"))
    meta = os.path.join(run, "checkpoints", "step_00000004", "meta.json")
    stored = json.load(open(meta))
    stored["config"]["model"]["d_model"] = 64  # a config that does not build the saved model
    json.dump(stored, open(meta, "w"))
    with pytest.raises(Exception, match="has embed.weight of shape .64, 256., but model.arch 'baseline' of its "
                       "config has .64, 64."):
        export(run, str(tmp_path / "out"), log=quiet)


def test_an_exported_folder_imports_as_a_run(tmp_path, corpus):
    from pretrain.export.importer import import_run

    run = train(tmp_path, corpus, **{"model.max_seq_len": 64})
    folder = str(tmp_path / "folder")
    export(run, folder, log=quiet)
    os.makedirs(tmp_path / f".again.tmp-{2 ** 22 + 1}")  # left by a killed import (no such pid)
    import_run(folder, str(tmp_path / "again"), log=quiet)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".again")]
    model, spec, _, _ = load_for_inference(run, log=quiet)
    imported, _, cfg, tok = load_for_inference(str(tmp_path / "again"), log=quiet)
    assert cfg.model == model.cfg and tok is not None
    with torch.no_grad():
        torch.testing.assert_close(spec.logits(imported, TOKENS), spec.logits(model, TOKENS), rtol=0, atol=0)


def test_a_damaged_folder_is_refused_naming_the_file(tmp_path, corpus):
    run = train(tmp_path, corpus)
    out = str(tmp_path / "folder")
    export(run, out, log=quiet)
    weights = os.path.join(out, WEIGHTS_FILE)
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.seek(size - 7)
        f.write(b"\x01")
    with pytest.raises(ValueError, match="model.safetensors is corrupt"):
        load_folder(out, log=quiet)
    with open(weights, "r+b") as f:
        f.truncate(size - 64)
    with pytest.raises(ValueError, match="model.safetensors is truncated"):
        load_folder(out, log=quiet)
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        f.write('{"format": "recurrent-pretrain", "format_version": 9}')
    with pytest.raises(ValueError, match="format_version 9; this code reads up to 1"):
        load_folder(out, log=quiet)


def test_bad_command_lines(tmp_path, corpus, capsys):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = train(tmp_path, corpus)
    assert main(["export", run, str(tmp_path / "new" / "dir" / "out")]) == 0  # parents are created
    assert os.path.isfile(tmp_path / "new" / "dir" / "out" / WEIGHTS_FILE)
    (tmp_path / "file").write_text("x")
    assert main(["export", run, str(tmp_path / "file" / "out")]) == 2
    assert "is a file, so" in capsys.readouterr().err
    assert main(["export", run, str(tmp_path / "out"), "--format", "hf", "--tokenizer", str(tmp_path / "x.json")]) == 2
    assert "x.json" in capsys.readouterr().err


EXPORT_LAYOUTS = {"tp2": ["parallel.tp=2"],
                  "dist-optimizer": ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"],
                  "zero3": ["parallel.data_parallel=deepspeed", "parallel.zero_stage=3"]}


def _train_layouts(rank, world_size, tmp, corpus):
    from trainer_helpers import partition_everything_under_zero3

    partition_everything_under_zero3()
    out = {}
    for layout, extra in EXPORT_LAYOUTS.items():
        config, over = tiny_config("baseline")
        cfg = load_config(config, over + run_overrides(tmp, corpus, **{
            "train.run_dir": f"{tmp}/{layout}", "train.max_steps": 2, "checkpoint.every": 2,
            "model.n_kv_heads": 2, "schedule.warmup_steps": 1}) + extra)
        trainer = Trainer(cfg, log=lambda *_: None)
        trainer.fit()
        model_sd, _ = trainer.engine.get_state()
        out[layout] = {k: v.detach().numpy().copy() for k, v in model_sd.items()}
    return out


def test_checkpoints_of_every_layout_export_their_weights(tmp_path, corpus):
    pytest.importorskip("megatron.core", reason="tensor parallelism needs megatron-core")
    pytest.importorskip("deepspeed", reason="ZeRO-3 needs DeepSpeed")
    from distributed import run_ranks

    trained = run_ranks(_train_layouts, 2, args=(str(tmp_path), corpus), env={"DS_ACCELERATOR": "cpu"},
                        timeout=600)[0]
    for layout, weights in trained.items():
        out = str(tmp_path / f"{layout}-folder")
        export(str(tmp_path / layout), out, log=quiet)
        model = load_folder(out, log=quiet)[0]
        got = model.state_dict()
        assert sorted(got) == sorted(weights), layout
        for name, value in weights.items():
            assert torch.equal(got[name], torch.from_numpy(value)), (layout, name)


@pytest.mark.parametrize("arch", ["baseline", "crt"])
def test_weights_saved_before_gqa_are_carried_forward_by_import(tmp_path, corpus, arch, capsys):
    """Runs saved with the fused attn.qkv projection (before model.n_kv_heads): resuming them is refused
    naming `pretrain import`, which splits the projection (registry upgrade_state) into a new run."""
    from pretrain.checkpoint import SavedModel, load_checkpoint, read_meta, save_checkpoint
    from pretrain.export.importer import import_run

    run = train(tmp_path, corpus, arch)
    ckpt = os.path.join(run, "checkpoints", "step_00000004")
    saved = SavedModel()
    load_checkpoint(ckpt, saved, restore_rng=False, log=quiet)
    old = {}
    for name, t in saved.state.items():
        if ".attn.q." in name:
            old[name.replace(".attn.q.", ".attn.qkv.")] = torch.cat([t, saved.state[name.replace(".q.", ".kv.")]])
        elif ".attn.kv." not in name:
            old[name] = t
    old_run = str(tmp_path / "old")
    saved.state = old
    meta = read_meta(ckpt)
    meta.pop("checksums")
    meta["config"]["train"]["run_dir"] = old_run
    save_checkpoint(old_run, 4, saved, None, {k: v for k, v in meta.items() if k not in ("step", "schema_version")})
    with pytest.raises(Exception, match="older version of this one: `pretrain import` upgrades its weights"):
        load_for_inference(old_run, log=quiet)
    import_run(old_run, str(tmp_path / "new"), log=quiet)
    model, spec, _, _ = load_for_inference(run, log=quiet)
    new, _, _, _ = load_for_inference(str(tmp_path / "new"), log=quiet)
    with torch.no_grad():
        torch.testing.assert_close(spec.logits(new, TOKENS), spec.logits(model, TOKENS), rtol=0, atol=0)
