"""Hugging Face Llama both ways, and Llama into CRT (pretrain/models/hf_llama.py, pretrain/export).

The Llama models are small random ones built locally with transformers itself (nothing is
downloaded); every comparison is fp32 logits to 1e-5 and greedy tokens identical.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pretrain.cli import main
from pretrain.export.importer import import_run
from pretrain.export.writer import export
from pretrain.generate import generate, load_for_inference
from pretrain.models.decoder import apply_rope, rope_tables
from pretrain.models.hf_llama import halves_to_pairs, pairs_to_halves
from test_export import TOKENS, quiet, train
from test_registry import run_overrides
from trainer_helpers import VOCAB, write_markov_corpus, write_word_tokenizer

transformers = pytest.importorskip("transformers", reason="the HF tests need transformers (a test extra)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def hf_logits(folder_or_model, tokens=TOKENS):
    model = folder_or_model
    if isinstance(model, str):
        model = transformers.LlamaForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float(), model


def hf_llama(folder, tie=False, kv=2, vocab=VOCAB, tokenizer=None, **extra):
    """A random LlamaForCausalLM saved to `folder` (with a tokenizer.json when given)."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64,
                                      rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from one, so that a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    if tokenizer:
        shutil.copy(tokenizer, os.path.join(folder, "tokenizer.json"))
    return model


def test_the_rotary_permutation_turns_pairs_into_halves():
    heads, dh, T = 3, 8, 5
    x = torch.randn(1, heads, T, dh, dtype=torch.float64)
    cos, sin = rope_tables(dh, T, 500.0)
    ours = apply_rope(x, cos.double()[None, None], sin.double()[None, None])
    half = pairs_to_halves(x.transpose(1, 2).reshape(T, heads * dh).T, heads).T.reshape(1, T, heads, dh).transpose(1, 2)
    c, s = torch.cat([cos, cos], -1).double(), torch.cat([sin, sin], -1).double()
    rotate_half = torch.cat([-half[..., dh // 2:], half[..., : dh // 2]], -1)
    hf = half * c + rotate_half * s  # transformers' apply_rotary_pos_emb
    back = halves_to_pairs(hf.transpose(1, 2).reshape(T, heads * dh).T, heads).T.reshape(1, T, heads, dh).transpose(1, 2)
    torch.testing.assert_close(back, ours, rtol=0, atol=1e-12)
    w = torch.randn(heads * dh, 7)
    assert torch.equal(halves_to_pairs(pairs_to_halves(w, heads), heads), w)


@pytest.mark.parametrize("extra", [{}, {"model.n_kv_heads": 2, "model.tie_embeddings": "false"}], ids=["mha-tied", "gqa"])
def test_export_hf_is_loaded_by_transformers_with_our_logits(tmp_path, corpus, extra):
    run = train(tmp_path, corpus, **extra)
    out = str(tmp_path / "hf")
    assert main(["export", run, out, "--format", "hf"]) == 0
    ours, spec, _, _ = load_for_inference(run, log=quiet)
    theirs, model = hf_logits(out)
    with torch.no_grad():
        torch.testing.assert_close(theirs, spec.logits(ours, TOKENS), rtol=0, atol=1e-5)
    prompt = TOKENS[:, :3]
    hf_ids = model.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    # both stop at the end of document (id 2; transformers pads the rows that ended)
    theirs_ids = [row[:row.index(2) + 1] if 2 in row else row for row in hf_ids[:, 3:].tolist()]
    assert theirs_ids == generate(ours, spec, prompt.tolist(), 8, temperature=0, eos_id=2)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("t5 t9 t11", add_special_tokens=False)["input_ids"] == [5, 9, 11] and tok.eos_token_id == 2
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == (2 if extra else 4)


def test_a_windowed_baseline_is_not_exported_as_llama(tmp_path, corpus):
    run = train(tmp_path, corpus, **{"model.window": 8})
    with pytest.raises(ValueError, match="model.window=8 .sliding-window attention. has no LlamaForCausalLM"):
        export(run, str(tmp_path / "hf"), fmt="hf", log=quiet)
    os.makedirs(tmp_path / "other")  # an architecture whose registry entry names no `hf` adapter (a test one;
    other = train(tmp_path / "other", corpus, "test_looped")  # every shipped one has: tests/test_hf_remote.py)
    with pytest.raises(ValueError, match="model.arch 'test_looped' has no Hugging Face counterpart"):
        export(other, str(tmp_path / "hf"), fmt="hf", log=quiet)
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_a_llama_then_fine_tune_it(tmp_path, corpus, tie, capsys):
    tok = write_word_tokenizer(tmp_path / "tok.json")
    llama = hf_llama(str(tmp_path / "llama"), tie=tie, tokenizer=tok)
    run = str(tmp_path / "imported")
    assert main(["import", str(tmp_path / "llama"), run]) == 0
    said = capsys.readouterr().out
    assert "model.arch 'baseline'" in said and "checkpoint.init_from=" in said
    ours, spec, cfg, _ = load_for_inference(run, log=quiet)
    assert (cfg.model.n_kv_heads, cfg.model.tie_embeddings, cfg.model.rope_theta) == (2, tie, 500.0)
    theirs, _ = hf_logits(llama)
    with torch.no_grad():
        torch.testing.assert_close(spec.logits(ours, TOKENS), theirs, rtol=0, atol=1e-5)
    # an imported run names no datasets: evaluating it asks for them in one sentence, then runs on them
    assert main(["eval", run]) == 2
    assert "no validation data: this run names no datasets" in capsys.readouterr().err
    data = [f"data.valid=[{corpus}]", "data.seq_len=32", f"data.cache_dir={tmp_path}/cache", "--batches", "1"]
    assert main(["eval", run, *data]) == 0
    assert "val loss" in capsys.readouterr().out
    # fine-tuning is a new run that starts from the imported weights; resuming the import is refused
    over = run_overrides(tmp_path, corpus, **{"train.max_steps": 2, "checkpoint.every": 2,
                                              "schedule.warmup_steps": 1})
    over = [o for o in over if not o.startswith(("model.", "data.tokenizer", "train.run_dir"))]
    assert main(["train", run, *over]) == 2
    assert "holds imported weights (pretrain import), not a run to resume" in capsys.readouterr().err
    ft = str(tmp_path / "ft")
    assert main(["train", run, *over, f"train.run_dir={ft}", f"checkpoint.init_from={run}"]) == 0
    assert f"initial weights from {os.path.abspath(run)}" in capsys.readouterr().out
    assert os.path.isdir(os.path.join(ft, "checkpoints", "step_00000002"))


def test_a_llama_converts_into_a_crt_that_computes_it_for_every_k(tmp_path):
    tok = write_word_tokenizer(tmp_path / "tok.json")
    llama = hf_llama(str(tmp_path / "llama"), tokenizer=tok)
    run = str(tmp_path / "crt")
    import_run(str(tmp_path / "llama"), run, arch="crt", overrides=["model.k_max=5", "model.k_min=2"], log=quiet)
    theirs, _ = hf_logits(llama)
    for k in (1, 2, 3, 4, 5, -1):  # every K up to k_max, and exactly
        model, spec, cfg, _ = load_for_inference(run, overrides=[f"model.eval_k={k}"], log=quiet)
        assert cfg.model.block == "llama" and cfg.model.n_kv_heads == 2
        with torch.no_grad():
            torch.testing.assert_close(spec.logits(model, TOKENS), theirs, rtol=0, atol=1e-5)
    with torch.no_grad():  # and its streaming decode, token by token
        state = spec.new_state(model, 2)
        streamed = torch.cat([spec.step(model, TOKENS[:, t:t + 1], state)[0] for t in range(TOKENS.shape[1])], 1)
    torch.testing.assert_close(streamed, theirs, rtol=0, atol=1e-5)


def test_a_baseline_run_converts_into_a_crt_run(tmp_path, corpus):
    run = train(tmp_path, corpus, **{"model.tie_embeddings": "false"})
    out = str(tmp_path / "crt")
    import_run(run, out, arch="crt", log=quiet)
    base, bspec, _, _ = load_for_inference(run, log=quiet)
    crt, cspec, cfg, tok = load_for_inference(out, overrides=["model.eval_k=3"], log=quiet)
    assert tok is not None and cfg.model.arch == "crt"
    with torch.no_grad():
        torch.testing.assert_close(cspec.logits(crt, TOKENS), bspec.logits(base, TOKENS), rtol=0, atol=1e-5)


def write_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(changes)
    json.dump(config, open(path, "w"))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "mistral", "sliding_window": 4096},
     "model_type 'mistral' .its sliding-window attention included. is not supported; Hugging Face folders of "
     "model_type llama, pretrain_cart, .* are imported"),
    ({"attention_bias": True}, "attention_bias=true is not supported: the baseline's Llama block has no biases"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling .'llama3'. is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"vocab_size": 40}, "the tokenizer .* has 64 tokens but the model's vocabulary is 40: they do not match"),
])
def test_unsupported_hf_folders_are_refused_in_one_sentence(tmp_path, changes, message):
    folder = str(tmp_path / "llama")
    hf_llama(folder, vocab=64 if "vocab_size" not in changes else 40, tokenizer=write_word_tokenizer(tmp_path / "t.json"))
    write_config(folder, **{k: v for k, v in changes.items() if k != "vocab_size"})
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        import_run(folder, out, log=quiet)
    assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if n.startswith(".out")]


def test_sharded_weights_and_default_rope_entries_are_read(tmp_path):
    folder = str(tmp_path / "llama")
    llama = hf_llama(folder)
    shutil.rmtree(folder)
    llama.save_pretrained(folder, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    write_config(folder, rope_scaling={"type": "default"})  # transformers 4's way of saying "none"
    run = str(tmp_path / "run")
    import_run(folder, run, log=quiet)
    ours, spec, _, _ = load_for_inference(run, log=quiet)
    with torch.no_grad():
        torch.testing.assert_close(spec.logits(ours, TOKENS), hf_logits(llama)[0], rtol=0, atol=1e-5)


def test_other_bad_imports(tmp_path, capsys):
    folder = str(tmp_path / "llama")
    hf_llama(folder)
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin"))
    assert main(["import", folder, str(tmp_path / "out")]) == 2
    assert "holds no model.safetensors" in capsys.readouterr().err
    os.makedirs(tmp_path / "taken")
    assert main(["import", folder, str(tmp_path / "taken")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    hf_llama(str(tmp_path / "ok"))
    assert main(["import", str(tmp_path / "ok"), str(tmp_path / "out"), "--arch", "crt", "model.n_layers=3"]) == 2
    assert "model.n_layers=2 into a CRT with model.n_layers=3: set it to 2" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "ok"), str(tmp_path / "out"), "--arch", "nope"]) == 2
    assert "model.arch 'nope' is not a known architecture" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_sentencepiece_tokenizer_is_shipped_as_transformers_loads_it(tmp_path, model_type):
    from data_tools.hf_tokenizer import model_type as stored_type
    from data_tools.tokenizer import load_tokenizer, train_sentencepiece
    from pretrain.models.hf_llama import ADAPTER

    root = os.path.dirname(os.__file__)
    texts = [open(os.path.join(root, n)).read() for n in sorted(os.listdir(root))[:30] if n.endswith(".py")]
    train_sentencepiece(texts, str(tmp_path / "spm"), vocab_size=400, model_type=model_type)
    assert stored_type(open(tmp_path / "spm.model", "rb").read()) == model_type
    ours = load_tokenizer(str(tmp_path / "spm.model"))
    os.makedirs(tmp_path / "hf")
    assert ADAPTER.write_tokenizer(str(tmp_path / "hf"), str(tmp_path / "spm.model"), ours) == [
        "tokenizer.model", "tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    text = "def f(x):\n    return x + 1  # The list type, ünïcode"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert (theirs.eos_token_id, theirs.bos_token_id) == (ours.eod_id, ours.special_ids()["bos"])
    # with transformers and tokenizers alone (sentencepiece and protobuf made unimportable), on mixed text:
    # unicode, byte fallback (emoji, CJK), runs of spaces, tabs, newlines, digits
    mixed = "naïve café — Grüße, 日本語のテキスト, emoji 🙂\n\n\tindented    code(x) = 12345  <0x41> <unk> <s>x</s> "
    code = ("import sys, json\nsys.modules['sentencepiece'] = None\nsys.modules['google.protobuf'] = None\n"
            "import transformers\n"
            f"t = transformers.AutoTokenizer.from_pretrained({str(tmp_path / 'hf')!r}, local_files_only=True)\n"
            f"print(json.dumps([t({mixed!r}, add_special_tokens=False)['input_ids'], t.decode(t({mixed!r}, "
            "add_special_tokens=False)['input_ids'])]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    ids, decoded = json.loads(r.stdout.strip().splitlines()[-1])
    assert ids == ours.encode(mixed) and decoded == mixed
