"""The command line as a user meets it (issue 26): the continuation keeps its word boundary with every
tokenizer kind, every sampling argument is checked before any work, and a Hugging Face folder is
pointed to `pretrain import`; a misspelled config gets the closest names."""
import os
import subprocess
import sys

import pytest
from pydoc_data.topics import topics

from data_tools.tokenizer import load_tokenizer, train_sentencepiece
from pretrain.cli import continuation
from trainer_helpers import write_word_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-m", "pretrain.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    docs = [topics[k] for k in sorted(topics)][:12]
    return load_tokenizer(train_sentencepiece(docs, tmp_path_factory.mktemp("sp") / "tok", vocab_size=600))


def test_a_continuation_that_starts_a_word_keeps_its_space(sp_tok, tmp_path):
    prompt = sp_tok.encode("The")
    new = sp_tok.encode("The list type")[len(prompt):]  # the pieces of " list type", the first one word-initial
    assert sp_tok.decode(new) == "list type"  # decoding the new pieces alone drops the boundary
    assert "The" + continuation(sp_tok, prompt, new) == "The list type"
    words = load_tokenizer(write_word_tokenizer(tmp_path / "words.json"))  # an HF tokenizer.json
    prompt, new = words.encode("t5 t9"), words.encode("t7 t8")
    assert "t5 t9" + continuation(words, prompt, new) == "t5 t9 t7 t8"


@pytest.mark.parametrize("args, sentence", [
    (["--max-tokens", "-5"], "--max-tokens must be at least 1, got -5"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0 is greedy), got -1.0"),
    (["--top-p", "2"], "--top-p must be in (0, 1] (1 turns it off), got 2.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (1 turns it off), got 0.0"),
    (["--top-k", "-3"], "--top-k must be >= 0 (0 keeps every token), got -3"),
    (["--num-samples", "0"], "--num-samples must be at least 1, got 0"),
])
def test_bad_sampling_arguments_are_one_sentence_before_any_work(args, sentence, tmp_path):
    run = tmp_path / "run"  # checked before the run is read: it need not exist, and nothing is written
    r = _cli("generate", str(run), *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"pretrain generate: error: {sentence}"
    assert not run.exists() and os.listdir(tmp_path) == []


def test_other_bad_arguments_are_one_line_with_nothing_written(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "torn.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    none, m = str(tmp_path / "none"), str(tmp_path / "m.jsonl")
    cases = [
        (["eval", none, "--batches", "-1"], "pretrain eval: error: --batches must be at least 1 (or left out for "
         "train.eval_batches), got -1"),
        (["plot", none], f"pretrain plot: error: {none} is neither a run directory with a metrics.jsonl nor a "
         "metrics.jsonl file"),
        (["plot", m, "--output", str(tmp_path / "no" / "x.png")], f"pretrain plot: error: --output "
         f"{tmp_path / 'no' / 'x.png'}: the folder {tmp_path / 'no'} does not exist"),
        (["plot", m, "--output", str(tmp_path / "x.txt")], f"pretrain plot: error: --output {tmp_path / 'x.txt'}: "
         "give a .png, .pdf or .svg file name"),
        (["plot", str(tmp_path / "torn.jsonl")], f"pretrain plot: error: {tmp_path / 'torn.jsonl'} line 2 is not a "
         "JSON record"),
        (["plot", str(tmp_path / "empty")], f"pretrain plot: error: {tmp_path / 'empty'} has no training step logged yet"),
        (["generate", none, "--max-tokens", "many"], "pretrain generate: error: argument --max-tokens: invalid int "
         "value: 'many' (see pretrain generate --help)"),
        (["export", none, str(tmp_path / "out")], f"pretrain export: error: {none} does not exist"),
        (["import", none, str(tmp_path / "out")], f"pretrain import: error: {none} does not exist"),
        (["info", "baseline/tiny", "model.n_layers=0"], "pretrain info: error: model.n_layers must be positive, got 0"),
    ]
    before = sorted(os.listdir(tmp_path))
    for args, line in cases:
        r = _cli(*args)
        assert (r.returncode, r.stderr.strip()) == (2, line)
    assert sorted(os.listdir(tmp_path)) == before


def test_every_option_has_help_and_numeric_ranges_are_stated():
    from pretrain.cli import _parser

    verbs = _parser()._subparsers._group_actions[0].choices
    for name, verb in verbs.items():
        for action in verb._actions:
            assert action.help, f"pretrain {name} {action.option_strings or action.dest} has no help"
            if action.type in (int, float) and action.option_strings != ["--seed"]:
                assert any(s in action.help for s in (">=", "> 0", "in (", "at least")), (name, action.option_strings)


def test_a_hugging_face_folder_is_pointed_to_pretrain_import(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = _cli("generate", str(tmp_path))
    assert r.returncode == 2 and "pretrain import" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_misspelled_config_gets_the_closest_names_and_info_lists_them():
    r = _cli("info", "crt/tny")
    assert r.returncode == 2 and "did you mean crt/tiny" in r.stderr, r.stderr
    assert len(r.stderr) < 300  # not every shipped config on one line
    listed = _cli("info", "--list")
    assert listed.returncode == 0 and "gpn/tiny" in listed.stdout.splitlines()
    bare = _cli("info")
    assert bare.returncode == 2 and "--list" in bare.stderr


def test_a_training_start_is_a_one_screen_summary_and_the_full_config_on_request(tmp_path):
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 1, "train.compile": "true",
                                                "schedule.warmup_steps": 0, "checkpoint.every": 0})
    # what is checked is the start, not the compilation: torch.compile is made a no-op (a minute on 2 cores saved)
    r = _cli("train", "baseline/tiny", *over, TORCH_COMPILE_DISABLE="1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = lines[:next(i for i, line in enumerate(lines) if line.startswith("step 1/"))]
    assert len(start) <= 25, start
    assert start[0] == f"config: {tmp_path / 'run' / 'config.yaml'} (every resolved field; log.show_config=true prints it here)"
    assert any(line.startswith("compiling the model: the first steps are slow") for line in start)
    assert "model:" in (tmp_path / "run" / "config.yaml").read_text()  # the whole config is in the run
    full = _cli("train", "baseline/tiny", *over, f"train.run_dir={tmp_path / 'full'}", "log.show_config=true",
                "train.compile=false")
    assert full.returncode == 0 and "\nmodel:\n  arch: baseline\n" in "\n" + full.stdout


@pytest.mark.parametrize("path, env, why", [
    ("flash_attn", {}, "the flash_attn package is not installed"),
    ("triton", {"TRITON_INTERPRET": "0"}, "its kernels run on CUDA devices (on a CPU only under TRITON_INTERPRET=1), "
     "not on cpu"),
    ("flex", {}, "it takes head dims 16, 32, 64, 128, 256"),  # the tiny test model's are 8 wide
], ids=["not-installed", "no-cuda", "head-dim"])
def test_a_forced_attention_path_that_cannot_serve_the_model_is_one_sentence_before_any_work(tmp_path, path, env,
                                                                                            why):
    """Issue 34: refused from a fake forward before the run starts (pretrain/kernel_probe.py), not at the
    first step after the run directory, the data and the compilation."""
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    before = sorted(os.listdir(tmp_path))
    over = tiny_overrides(tmp_path, corpus, **{"model.document_mask": "true", "train.compile": "true"})
    r = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny", *over], capture_output=True,
                       text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, PRETRAIN_KERNELS=f"attention={path}", **env))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"pretrain train: error: before training model.arch=baseline on cpu: the attention path {path!r} (forced by "
        f"PRETRAIN_KERNELS) cannot serve this call: {why}; unset it or choose another of flash_attn, triton, flex, "
        "sdpa, reference")
    assert r.stdout == "" and sorted(os.listdir(tmp_path)) == before  # no run directory, no data cache


def test_eval_caps_k_at_t_plus_1_says_so_and_shows_the_diagnostics(tmp_path):
    """CRT's model.eval_k beyond T + 1 evaluates as T + 1 (the same loss), with a line saying so; the
    text output names the K and the model's diagnostics; runtime settings are accepted as by train."""
    import json

    from pretrain.config import load_config
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.compile": "false", "checkpoint.every": 0,
                                                "schedule.warmup_steps": 0, "model.k_max": 3})
    Trainer(load_config("crt/tiny", over), log=lambda *_: None).fit()
    run = str(tmp_path / "run")
    capped = _cli("eval", run, "model.eval_k=100000", "train.threads=1", "--batches", "2")
    assert capped.returncode == 0, capped.stderr
    assert "K = T + 1 = 33 passes: model.eval_k=100000 is capped there" in capped.stdout
    assert "diagnostics: " in capped.stdout
    loss = lambda k: json.loads(_cli("eval", run, f"model.eval_k={k}", "--batches", "2", "--json").stdout)["val_loss"]  # noqa: E731
    assert loss(100000) == loss(33)
    bad = _cli("eval", run, "train.device=tpu")
    assert bad.returncode == 2 and "train.device must be auto, cpu or cuda" in bad.stderr


def test_the_readmes_python_snippet_loads_a_folder_and_computes_logits_and_a_token(tmp_path):
    """The README's five lines, run as written on a freshly exported folder."""
    from pretrain.cli import main
    from pretrain.config import load_config
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    tok = write_word_tokenizer(tmp_path / "words.json")
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.compile": "false", "checkpoint.every": 0,
                                                "schedule.warmup_steps": 0, "data.tokenizer": tok})
    Trainer(load_config("baseline/tiny", over), log=lambda *_: None).fit()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "folder")]) == 0
    readme = open(os.path.join(ROOT, "README.md")).read()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "load_folder" in snippet and len(snippet.strip().splitlines()) <= 6
    code = snippet.replace("exports/quickstart", str(tmp_path / "folder")).replace("The list type", "t5 t9")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("t5 t9 t")


def test_progress_shows_on_a_terminal_only(monkeypatch):
    import io

    from pretrain import cli

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    report = cli._progress("exporting tensors")
    for done in range(1, 4):
        report(done, 3)
    assert term.getvalue().endswith("\rexporting tensors: 3/3\n")
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, a pipe: nothing
    assert cli._progress("evaluating batches") is None


# -- through a trained run: the printed continuation and Hugging Face's greedy decode agree ---------
NOUNS = ("list", "dict", "set", "tuple", "string", "integer", "float", "module", "class", "function")
ADJECTIVES = ("mutable", "ordered", "hashable", "iterable", "immutable", "callable")


def _hf_word_tokenizer(texts, path) -> str:
    """A Hugging Face BPE tokenizer.json with a metaspace pre-tokenizer: like sentencepiece, decoding a
    word-initial piece alone drops its space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=[
        "<unk>", "<s>", "</s>", "<pad>", "<predict>"]))
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module", params=["sentencepiece", "hf"])
def word_run(request, tmp_path_factory):
    """A tiny baseline trained on sentences 'The list type is mutable.' ... with each tokenizer kind, and
    its Hugging Face export."""
    import json
    import random

    from data_tools.cli import main as data_main
    from pretrain.cli import main
    from pretrain.config import load_config
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides

    tmp = tmp_path_factory.mktemp(request.param)
    rng = random.Random(0)
    texts = [" ".join(f"The {rng.choice(NOUNS)} type is {rng.choice(ADJECTIVES)}." for _ in range(6)) for _ in range(300)]
    with open(tmp / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tok = (str(load_tokenizer(train_sentencepiece(texts, tmp / "spm", vocab_size=300)).path)
           if request.param == "sentencepiece" else _hf_word_tokenizer(texts, tmp / "tokenizer.json"))
    assert data_main(["preprocess", "--input", str(tmp / "docs.jsonl"), "--tokenizer-model", tok, "--output-prefix",
                      str(tmp / "docs"), "--workers", "1", "--no-progress"]) == 0
    over = tiny_overrides(tmp, tmp / "docs_text_document", **{
        "model.vocab_size": 320, "data.tokenizer": tok, "train.max_steps": 120, "train.compile": "false",
        "checkpoint.every": 0, "train.eval_every": 0, "optim.lr": 1e-2, "schedule.warmup_steps": 5})
    Trainer(load_config("baseline/tiny", over), log=lambda *_: None).fit()
    assert main(["export", str(tmp / "run"), str(tmp / "hf"), "--format", "hf"]) == 0
    return tmp, load_tokenizer(tok)


def test_generate_prints_the_continuation_with_its_word_boundary(word_run):
    tmp, tok = word_run
    r = _cli("generate", str(tmp / "run"), "--prompt", "The", "--temperature", "0", "--max-tokens", "6",
             "train.threads=1", "train.device=cpu")  # runtime settings, as train takes them
    assert r.returncode == 0, r.stderr
    text = r.stdout.rstrip("\n")
    prompt = tok.encode("The")
    new = tok.encode(text)[len(prompt):]
    assert tok.encode(text)[:len(prompt)] == prompt and len(new) == 6
    assert text.startswith("The ") and not tok.decode(new).startswith(" ")  # the space the bare decode drops
    assert text.split()[1] in NOUNS  # it learned the sentences: the first word is whole


def test_hugging_face_generate_reproduces_pretrain_generate_greedy(word_run):
    """The HF export's AutoTokenizer + AutoModelForCausalLM.generate (greedy) print what `pretrain
    generate --temperature 0` prints, with transformers and tokenizers alone (no sentencepiece)."""
    tmp, _ = word_run
    ours = _cli("generate", str(tmp / "run"), "--prompt", "The set type", "--temperature", "0", "--max-tokens", "12")
    assert ours.returncode == 0, ours.stderr
    code = ("import sys\nsys.modules['sentencepiece'] = None\nsys.modules['google.protobuf'] = None\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"tok = AutoTokenizer.from_pretrained({str(tmp / 'hf')!r})\n"
            f"model = AutoModelForCausalLM.from_pretrained({str(tmp / 'hf')!r})\n"
            "ids = tok('The set type', return_tensors='pt', add_special_tokens=False).input_ids\n"
            "out = model.generate(ids, do_sample=False, max_new_tokens=12)\n"
            "print(tok.decode(out[0], skip_special_tokens=True))")
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert theirs.stdout.strip().splitlines()[-1] == ours.stdout.rstrip("\n")
