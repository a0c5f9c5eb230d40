"""Registry-wide tests: what every architecture passes once it registers (docs/adding-an-architecture.md).

Parametrized over the registry, so an architecture that registers later is covered at once:
registration rules, the parameter counts its shipped configs declare, streaming decode against the
parallel forward in float64 (chunked prefill, then token by token) as its entry declares, generation
from a trained tiny run, a golden loss curve, and SIGKILL-then-resume bit for bit. Each shipped
architecture runs from its `configs/<arch>/tiny.yaml`; the test architectures of looped_model.py
reuse the baseline's. The layout matrix is tests/test_layout_matrix.py.

Golden curves live one file per architecture, tests/golden/<arch>.json, so recording one touches no
other architecture's record; a new architecture records its own with
`PRETRAIN_RECORD_GOLDEN=1 pytest tests/test_registry.py -k "golden and <arch>"` (and says why in its
commit). Recording never overwrites: re-recording means deleting the file, deliberately.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import looped_model  # noqa: F401  (registers the test architectures)
import prefix_lm_model  # noqa: F401  (a test architecture with a mask of its own)
from pretrain.cli import main
from pretrain.config import load_config, shipped_configs
from pretrain.metrics import read_metrics
from pretrain.models import ArchSpec, Support, all_archs, count_parameters, get_arch, meta_model, register
from pretrain.trainer import Trainer
from trainer_helpers import VOCAB, write_markov_corpus, write_word_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
ALL = [s.name for s in all_archs()]
SHIPPED = [a for a in ALL if not a.startswith("test_")]  # runnable from the command line


def tiny_config(arch: str) -> tuple[str, list[str]]:
    """(config, overrides) of an architecture's tiny config; test architectures borrow the baseline's."""
    return ("baseline/tiny", [f"model.arch={arch}"]) if arch.startswith("test_") else (f"{arch}/tiny", [])


def run_overrides(tmp, corpus, tokenizer="''", **extra) -> list[str]:
    """A seconds-long run of any tiny config on the Markov corpus (only ModelConfig's fields change)."""
    values = {"model.vocab_size": VOCAB, "data.train": f"[{corpus}]", "data.valid": "[]", "data.split": "90,10",
              "data.tokenizer": tokenizer, "data.seq_len": 32, "data.num_workers": 0, "data.cache_dir": f"{tmp}/cache",
              "train.run_dir": f"{tmp}/run", "train.max_steps": 12, "train.global_batch_seqs": 8,
              "train.micro_batch_seqs": 4, "train.log_every": 1, "train.eval_every": 0, "train.eval_batches": 2,
              "train.threads": 1, "train.compile": "false", "schedule.warmup_steps": 3, "checkpoint.every": 4,
              "log.peak_tflops": 1.0, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def test_registration_rules():
    from pretrain.models.base import ModelConfig

    assert all(issubclass(s.config_cls, ModelConfig) for s in all_archs())
    base = dict(build=None, flops_per_token=None)
    with pytest.raises(TypeError, match="must derive from pretrain.models.base.ModelConfig"):
        register(ArchSpec(name="test_bad", config_cls=dict, **base))
    with pytest.raises(ValueError, match="refuses tp, zero without a reason"):
        Support(tp=False, zero_stages=(0, 1), reasons={"sp": "x"})
    # Model modules are found by the registry; it imports none of them itself (no cycle).
    code = ("import sys, pretrain.models.registry as r; assert 'pretrain.models.baseline' not in sys.modules; "
            "print(r.get_arch('baseline').name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "baseline", out.stderr


def test_shipped_configs_have_the_parameter_counts_they_declare():
    declared = set()
    for name in shipped_configs():
        cfg = load_config(name, check_data=False)
        if not cfg.model.paper_params:
            continue
        declared.add(cfg.model.arch)
        with torch.device("meta"):
            total = count_parameters(get_arch(cfg.model.arch).build(cfg.model))["total"]
        if cfg.model.paper_params_rounded:
            assert abs(total - cfg.model.paper_params) <= 1e-3 * cfg.model.paper_params, name
        else:
            assert total == cfg.model.paper_params, name
    assert declared >= set(SHIPPED), f"no shipped config declares its paper's count: {set(SHIPPED) - declared}"


def _meta_tiny(arch):
    config, over = tiny_config(arch)
    return meta_model(load_config(config, over, check_data=False).model)


@pytest.mark.parametrize("arch", ALL)
def test_every_parameter_belongs_to_a_unit_or_an_end_and_a_stage_keeps_only_its_own(arch):
    """The units (pretrain/models/units.py) own every parameter, so keep_stage can drop what a stage does not
    run without a list of names: a parameter no unit owns would be dropped from every stage (fails here)."""
    from pretrain.models.units import Whole, owned_parameters

    model = _meta_tiny(arch)
    if isinstance(model, Whole):  # one unit: a stage is the whole model
        assert model.pipeline_units() == 1
        return
    units = model.units()
    assert model.pipeline_units() == len(units) > 0
    owned = owned_parameters(model, [x for u in units for x in u.owns] + list(model.ends()))
    assert [n for n, p in model.named_parameters() if id(p) not in owned] == []
    if not get_arch(arch).supports.pp:
        return
    for i in range(len(units)):  # a stage of one unit keeps exactly that unit's parameters and its ends
        first, last = i == 0, i == len(units) - 1
        model = _meta_tiny(arch)
        ends = [model.embed] * first + [model.norm, model.head] * last
        want = owned_parameters(model, [*model.units()[i].owns, *ends])
        numel = {id(p): p.numel() for p in model.parameters()}
        model.keep_stage({i}, first, last)
        assert sum(p.numel() for p in model.parameters()) == sum(numel[k] for k in want), (arch, i)


@pytest.mark.parametrize("arch", ALL)
def test_streaming_decode_equals_the_parallel_forward(arch):
    spec = get_arch(arch)
    config, over = tiny_config(arch)
    exact_under = [f"model.{k}={v}" for k, v in spec.decode.config.items()]  # where the relation holds
    cfg = load_config(config, over + exact_under + [f"model.vocab_size={VOCAB}"], check_data=False)
    torch.manual_seed(0)
    model = spec.build(cfg.model).double().eval()
    tokens = torch.randint(5, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = spec.logits(model, tokens)
        state = spec.new_state(model, 2)
        first, state = spec.step(model, tokens[:, :5], state)  # chunked prefill, then one by one
        pieces = [first]
        for t in range(5, 13):
            logits, state = spec.step(model, tokens[:, t : t + 1], state)
            pieces.append(logits)
    streamed = torch.cat(pieces, dim=1)
    assert full.dtype == streamed.dtype == torch.float64 and full.shape == (2, 13, VOCAB)
    atol = 1e-10 if spec.decode.kind == "exact" else spec.decode.atol
    assert spec.decode.kind in ("exact", "tolerance") and (spec.decode.kind == "exact" or spec.decode.why)
    torch.testing.assert_close(streamed, full, rtol=0, atol=atol)


DOCUMENT_FIELDS = ("document_mask", "reset_at_documents")  # what makes training follow documents: masks, resets


def _document_masked(arch):
    """(spec, model config, model in float64) of an architecture's tiny config with its document field
    on (DOCUMENT_FIELDS), where its config has one and accepts it (the refusal's sentence otherwise)."""
    spec = get_arch(arch)
    field = next((f.name for f in dataclasses.fields(spec.config_cls) if f.name in DOCUMENT_FIELDS), None)
    if field is None:
        pytest.skip(f"{arch} has none of {', '.join(DOCUMENT_FIELDS)} (nothing follows documents)")
    config, over = tiny_config(arch)
    exact_under = [f"model.{k}={v}" for k, v in spec.decode.config.items()]
    try:
        cfg = load_config(config, over + exact_under + [f"model.vocab_size={VOCAB}", f"model.{field}=true"],
                          check_data=False)
    except ValueError as e:  # a ConfigError, or the model config's own validate()
        pytest.skip(f"{arch} refuses model.{field}=true: {e}")
    torch.manual_seed(0)
    return spec, cfg.model, spec.build(cfg.model).double().eval()


@pytest.mark.parametrize("arch", ALL)
def test_decode_across_documents_follows_the_training_mask(arch):
    """With model.document_mask (or a recurrence's reset_at_documents), a sequence holding EOS tokens:
    streaming decode equals `logits`, and both equal the training forward on the batch the data path
    makes of it (documents split after each EOS, positions restarting), position by position, through
    the loss at each position alone."""
    from pretrain.data.batch import collate

    spec, cfg, model = _document_masked(arch)
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(5, VOCAB, (2, 14), generator=g)
    raw[0, [3, 4, 9]] = cfg.eos_id  # an empty document too
    raw[1, 6] = cfg.eos_id
    doc = (raw == cfg.eos_id).long().cumsum(1) - (raw == cfg.eos_id).long()
    batch = collate((raw.numpy(), doc.numpy()), eod_id=cfg.eos_id)
    tokens, T = batch.tokens, batch.tokens.shape[1]
    with torch.no_grad():
        full = spec.logits(model, tokens)
        state = spec.new_state(model, 2)
        pieces = [spec.step(model, tokens[:, :5], state)[0]]
        pieces += [spec.step(model, tokens[:, t:t + 1], state)[0] for t in range(5, T)]
    atol = 1e-10 if spec.decode.kind == "exact" else spec.decode.atol
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=atol)
    for t in range(T):  # the forward's loss at position t alone is the cross-entropy of logits[:, t]
        only = torch.zeros_like(batch.loss_mask)
        only[:, t] = True
        with torch.no_grad():
            loss, _ = model(dataclasses.replace(batch, loss_mask=only))
        want = torch.nn.functional.cross_entropy(full[:, t], batch.labels[:, t])
        torch.testing.assert_close(loss, want, rtol=0, atol=1e-10, msg=f"{arch}: position {t}")


@pytest.mark.parametrize("arch", SHIPPED)
def test_generate_from_a_trained_tiny_run(arch, tmp_path, corpus, capsys):
    config, over = tiny_config(arch)
    tok = write_word_tokenizer(tmp_path / "tok.json")
    Trainer(load_config(config, over + run_overrides(tmp_path, corpus, tok, **{"train.max_steps": 4})),
            log=lambda *_: None).fit()
    capsys.readouterr()
    argv = ["generate", str(tmp_path / "run"), "--prompt", "t5 t9", "--max-tokens", "6", "--seed", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("t5 t9") and len(first.strip()) > len("t5 t9")  # something was sampled
    assert main(argv) == 0 and capsys.readouterr().out == first  # the same seed, the same sample


@pytest.mark.parametrize("arch", SHIPPED)
def test_golden_loss_curve(arch, tmp_path, corpus):
    config, over = tiny_config(arch)
    threads = torch.get_num_threads()
    try:
        # in float64: fp32 curves differ by up to 4e-6 between CPUs (other SIMD kernels, summation orders;
        # CRT's K passes amplify it), fp64 ones by ~1e-16, so a tight tolerance holds on any machine
        overrides = over + run_overrides(tmp_path, corpus, **{"train.precision": "fp64"})
        Trainer(load_config(config, overrides), log=lambda *_: None).fit()
    finally:
        torch.set_num_threads(threads)
    got = [losses(tmp_path / "run")[s] for s in range(1, 13)]
    path = os.path.join(GOLDEN_DIR, f"{arch}.json")
    if os.environ.get("PRETRAIN_RECORD_GOLDEN") == "1" and not os.path.exists(path):
        with open(path, "w") as f:
            f.write(json.dumps(got, indent=1) + "\n")
    assert os.path.exists(path), f"no golden curve for {arch} ({path}): record it with PRETRAIN_RECORD_GOLDEN=1"
    with open(path) as f:
        golden = json.load(f)
    # Exact on the recording machine; 1e-10 relative leaves room for other CPUs' rounding (threads 1 vs 2
    # moved a curve by 2e-16) and none for a change of the math: a reordered sum in fp32 moves it by ~1e-7.
    assert got == pytest.approx(golden, rel=1e-10, abs=0)
    assert got[-1] < got[0]


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pretrain.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("arch", SHIPPED)
def test_sigkill_and_resume_is_bit_identical(arch, tmp_path, corpus):
    config, over = tiny_config(arch)
    base = over + run_overrides(tmp_path, corpus, **{"train.max_steps": 24, "schedule.warmup_steps": 5,
                                                     "checkpoint.every": 4})
    whole = [o.replace(str(tmp_path / "run"), str(tmp_path / "whole")) for o in base]
    assert run_cli("train", config, *whole).returncode == 0

    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "pretrain.cli", "train", config, *base], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:  # kill it between the second and the third checkpoint
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(metrics.read_text().splitlines())
    assert 10 <= killed_at < 24, "the run must be killed in the middle"

    resumed = run_cli("train", config, *base)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    want, got = losses(tmp_path / "whole"), losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 25))
    assert got == want  # every step, before and after the kill, bit for bit
