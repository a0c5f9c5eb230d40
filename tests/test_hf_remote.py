"""Every non-Llama architecture as transformers remote code (pretrain/hf_remote).

- the shipped files are what the generator writes today (a model edit without regenerating fails here);
- every shipped config's model section (sizes shrunk to the tiny config's) builds the same model in the
  generated file, with the project's logits in float64 to 1e-10;
- a trained tiny run exported with --format hf loads with AutoModelForCausalLM (trust_remote_code) in
  a process that cannot import the project, megatron, sentencepiece or protobuf, and gives our logits
  (fp32: 1e-5 of the largest; fp64: 1e-10), our greedy tokens, sampling, and one-sentence refusals of
  padded batches and beams; `pretrain import` reads the folder back to the same tensors.
"""
import ast
import glob
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from pretrain.export.importer import import_run
from pretrain.export.writer import export
from pretrain.generate import generate, load_for_inference
from pretrain.hf_remote.generate import SHIPPED, class_names, file_names, remote_archs, render, shipped
from pretrain.models import get_arch
from test_export import TOKENS, quiet, train
from test_registry import ROOT
from trainer_helpers import write_markov_corpus

transformers = pytest.importorskip("transformers", reason="the remote-code tests need transformers (a test extra)")
ARCHS = ["cart", "crt", "gpn", "rt", "sps"]
# the fields a shipped config is shrunk by (to the tiny config's values): sizes, never options
SIZES = {"sps": ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"),
         "crt": ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"),
         "rt": ("d_model", "n_layers", "n_heads", "max_seq_len", "ffn_hidden"),
         "cart": ("d_model", "n_heads", "n_layers", "max_seq_len", "ffn_hidden"),
         "gpn": ("d_emb", "d_state", "d_ffn", "mem_heads", "d_key", "d_value", "max_seq_len")}
IDS = ("eos_id", "predict_id")  # the tokenizer's: the tiny vocabulary's ids


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def test_every_architecture_but_the_baseline_ships_remote_code():
    assert remote_archs() == ARCHS
    assert get_arch("baseline").hf.model_type == "llama"


@pytest.mark.parametrize("arch", ARCHS)
def test_shipped_remote_code_is_what_the_generator_writes(arch):
    assert render(arch) == shipped(arch), "regenerate: python -m pretrain.hf_remote.generate"
    for text in shipped(arch).values():  # every import of both files, at any depth: torch, transformers, stdlib
        imported = {a.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names}
        imported |= {"." if n.level else n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}
        tops = {m.split(".")[0] or "." for m in imported}
        assert tops <= {"__future__", "torch", "transformers", "numpy", "dataclasses", "math", "typing", "contextlib",
                        "weakref", "."}, tops


def load_generated(arch: str):
    """The generated modeling module, imported as transformers would (a package holding both files)."""
    name = f"_remote_{arch}"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [SHIPPED]
        sys.modules[name] = pkg
        mod = file_names(arch)[1][:-3]
        spec = importlib.util.spec_from_file_location(f"{name}.{mod}", os.path.join(SHIPPED, f"{mod}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        pkg.modeling = module
    return sys.modules[name].modeling


def shipped_configs(arch: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(ROOT, "configs", arch, "*.yaml")))


def model_section(path: str) -> dict:
    from pretrain.config import load_config

    cfg = load_config(os.path.relpath(path, os.path.join(ROOT, "configs"))[:-5], [], check_data=False, log=quiet)
    from dataclasses import asdict

    return asdict(cfg.model)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shipped_config_builds_the_same_model_in_the_remote_code(arch):
    spec, module = get_arch(arch), load_generated(arch)
    tiny = model_section(os.path.join(ROOT, "configs", arch, "tiny.yaml"))
    tokens = torch.randint(5, 64, (2, 13), generator=torch.Generator().manual_seed(3))
    tokens[0, 5] = tiny.get("eos_id", 2)  # a document boundary
    checked = []
    for path in shipped_configs(arch):
        fields = {**model_section(path), **{k: tiny[k] for k in SIZES[arch] + IDS if k in tiny}, "vocab_size": 64,
                  "paper_params": 0}
        torch.manual_seed(0)
        ours = spec.build(spec.config_cls(**fields)).double().eval()
        theirs_cls = getattr(module, spec.build.__name__)
        theirs = theirs_cls(getattr(module, spec.config_cls.__name__)(**fields)).double().eval()
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            a, b = spec.logits(ours, tokens), theirs.logits(tokens)
        assert a.dtype == b.dtype == torch.float64
        assert (a - b).abs().max().item() <= 1e-10, os.path.basename(path)
        checked.append(os.path.basename(path))
    assert len(checked) == len(shipped_configs(arch))


CHILD = r"""
import builtins, json, sys
real = builtins.__import__
BANNED = ("pretrain", "parallel", "kernels", "data_tools", "megatron", "deepspeed", "sentencepiece", "triton")
def guard(name, globals=None, locals=None, fromlist=(), level=0):
    if not level and (name.split(".")[0] in BANNED or name.startswith("google.protobuf")):
        raise ImportError(f"the remote code imported {name}")
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = guard
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, tokens, prompt = sys.argv[1], torch.tensor(json.loads(sys.argv[2])), torch.tensor(json.loads(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(folder)
with torch.no_grad():
    logits = model(tokens).logits
greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
torch.manual_seed(0)
sampled = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=5, eos_token_id=None, pad_token_id=0)
refusals = []
for kwargs in ({"attention_mask": torch.tensor([[0, 1, 1]])}, {"num_beams": 2}):
    try:
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0, **kwargs)
    except ValueError as e:
        refusals.append(str(e))
banned = sorted(m for m in sys.modules if m.split(".")[0] in BANNED)
print("\n" + json.dumps({"logits": logits.tolist(), "dtype": str(logits.dtype), "greedy": greedy[:, prompt.shape[1]:].tolist(),
                  "sampled": sampled.shape[1], "refusals": refusals, "banned": banned,
                  "tokenizer": tok("t5 t9")["input_ids"]}))
"""


def check_in_transformers(python: str, arch: str, precision: str, tmp_path, corpus) -> None:
    """Export a trained tiny run with --format hf and check it with transformers under `python` (see CHILD)."""
    extra = {"train.precision": "fp64"} if precision == "fp64" else {}
    run = train(tmp_path, corpus, arch, **extra)
    out = str(tmp_path / "hf")
    export(run, out, fmt="hf", log=quiet)
    config_file, modeling_file = file_names(arch)
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "generation_config.json", config_file, modeling_file} <= files
    hf = json.load(open(os.path.join(out, "config.json")))
    assert hf["auto_map"]["AutoModelForCausalLM"] == f"{modeling_file[:-3]}.{class_names(arch)[1]}"
    assert "trust_remote_code=True" in open(os.path.join(out, "README.md")).read()

    model, spec, _, tok = load_for_inference(run, log=quiet)
    assert next(model.parameters()).dtype == (torch.float64 if precision == "fp64" else torch.float32)
    prompt = TOKENS[:1, :3]
    child = subprocess.run([python, "-c", CHILD, out, json.dumps(TOKENS.tolist()), json.dumps(prompt.tolist())],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""), cwd=str(tmp_path))
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout[child.stdout.rindex('\n{"logits"'):])
    with torch.no_grad():
        ours = spec.logits(model, TOKENS)
    theirs = torch.tensor(got["logits"], dtype=torch.float64)
    assert got["dtype"] == str(ours.dtype) and got["banned"] == []
    bound = 1e-10 if precision == "fp64" else 1e-5 * ours.abs().max().item()
    assert (theirs - ours.double()).abs().max().item() <= bound
    assert got["greedy"] == generate(model, spec, prompt.tolist(), 8, temperature=0, pad_id=tok.pad_id)
    suppressed = json.load(open(os.path.join(out, "generation_config.json"))).get("suppress_tokens", [])
    assert set(spec.internal_tokens(model.cfg).values()) <= set(suppressed)  # SPS's <predict>, as ours
    assert got["sampled"] == 11
    assert "padded" in got["refusals"][0] and "beam search" in got["refusals"][1]
    assert got["tokenizer"] == tok.encode("t5 t9")

    again = str(tmp_path / "again")  # and back into a run: the same tensors
    import_run(out, again, overrides=[f"train.precision={precision}"], log=quiet)
    imported, _, cfg, _ = load_for_inference(again, log=quiet)
    assert cfg.model == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), imported.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
@pytest.mark.parametrize("arch", ARCHS)
def test_exported_folder_runs_in_transformers_alone(arch, precision, tmp_path, corpus):
    check_in_transformers(sys.executable, arch, precision, tmp_path, corpus)


TRANSFORMERS_4 = "4.57.6"


@pytest.fixture(scope="session")
def transformers_4():
    """A virtual environment with torch 2.13.0 and transformers 4.57 only (kept in /tmp between runs)."""
    venv = f"/tmp/pretrain-transformers-{TRANSFORMERS_4}"
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", "import transformers, torch; print(transformers.__version__)"]
    if not (os.path.exists(python) and subprocess.run(probe, capture_output=True, text=True).stdout.strip()
            == TRANSFORMERS_4):
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        for spec in ("torch==2.13.0", f"transformers=={TRANSFORMERS_4}"):
            done = subprocess.run([python, "-m", "pip", "install", "-q", spec], capture_output=True, text=True)
            if done.returncode:
                pytest.skip(f"could not install {spec} into a fresh virtual environment: {done.stderr[-300:]}")
    return python


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_4_loads_the_same_folders(arch, tmp_path, corpus, transformers_4):
    check_in_transformers(transformers_4, arch, "fp32", tmp_path, corpus)


def test_a_remote_folder_that_does_not_match_its_config_is_refused(tmp_path, corpus):
    run = train(tmp_path, corpus, "gpn")
    out = str(tmp_path / "hf")
    export(run, out, fmt="hf", log=quiet)
    path = os.path.join(out, "config.json")
    good = json.load(open(path))
    for change, message in (({"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "auto_map"),
                            ({"pretrain_model": {**good["pretrain_model"], "d_state": 64}}, "has shape"),
                            ({"pretrain_model": {**good["pretrain_model"], "colour": 1}}, "'colour', not a field"),
                            ({"pretrain_model": None}, "no `pretrain_model`")):
        json.dump({**good, **change}, open(path, "w"))
        with pytest.raises(ValueError, match=message):
            import_run(out, str(tmp_path / "again"), log=quiet)
        assert not os.path.exists(tmp_path / "again")


def test_without_the_harness_lm_eval_is_one_sentence(tmp_path, monkeypatch, capsys):
    import importlib.util as util

    from pretrain.cli import main

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert main(["eval", str(tmp_path), "--lm-eval", "hellaswag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lm-eval needs lm-evaluation-harness" in err[0] and "[lm-eval] extra" in err[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (from_pretrained with device_map='cuda')")
@pytest.mark.parametrize("arch", ARCHS)
def test_a_folder_loads_onto_a_gpu_by_device_map_in_bf16(arch, tmp_path, corpus):
    """transformers 5 makes the computed buffers (RoPE tables, ALiBi slopes) empty on the mapped device, then asks
    _init_weights for their values: they must land there, beside the weights, not on the CPU they were built on."""
    from transformers import AutoModelForCausalLM

    run = train(tmp_path, corpus, arch)
    out = str(tmp_path / "hf")
    export(run, out, fmt="hf", log=quiet)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, device_map="cuda",
                                                 torch_dtype=torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    with torch.no_grad():
        theirs = model(TOKENS.cuda()).logits.float().cpu()
    ours_model, spec, _, _ = load_for_inference(run, log=quiet)
    with torch.no_grad():
        ours = spec.logits(ours_model, TOKENS).float().cpu()
    assert (theirs - ours).abs().max().item() <= 0.1 * ours.abs().max().item()  # bf16 weights against ours
    assert model.generate(TOKENS[:1, :3].cuda(), max_new_tokens=4, do_sample=False, pad_token_id=0).shape[1] == 7
