"""`pretrain-data` as a newcomer uses it: help, the documented path end to end, and one-line errors."""
import json
import os
import subprocess
import sys

import numpy as np

from data_tools.cli import main
from data_tools.indexed import IndexedDataset, IndexedWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERBS = ("corpus", "train-tokenizer", "preprocess", "inspect", "merge")


def _py(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


def test_help_is_fast_and_imports_no_torch_or_datasets():
    code = ("import sys\nfrom data_tools.cli import main\n"
            "for argv in (['--help'],) + tuple([v, '--help'] for v in %r):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = [m for m in ('torch', 'datasets', 'pyarrow', 'sentencepiece') if m in sys.modules]\n"
            "print('HEAVY', heavy)" % (VERBS,))
    r = _py(code)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    for verb in VERBS:
        assert verb in r.stdout
    assert "--output-prefix" in r.stdout and "example" in r.stdout


def test_documented_path_end_to_end(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    assert main(["corpus", "--output", str(corpus)]) == 0
    first = (corpus / "train.jsonl").read_bytes()
    assert main(["corpus", "--output", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "train.jsonl").read_bytes() == first  # deterministic extraction
    assert main(["train-tokenizer", "--input", str(corpus / "valid.jsonl"), "--vocab-size", "500",
                 "--output-prefix", str(tmp_path / "tok" / "spm"), "--threads", "1"]) == 0
    model = str(tmp_path / "tok" / "spm.model")
    assert main(["preprocess", "--input", str(corpus / "valid.jsonl"), "--tokenizer-model", model,
                 "--output-prefix", str(tmp_path / "v"), "--workers", "2", "--no-progress"]) == 0
    n_docs = sum(1 for _ in open(corpus / "valid.jsonl"))
    ds = IndexedDataset(tmp_path / "v_text_document")
    assert ds.num_documents == n_docs
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "v_text_document.idx"), "--tokenizer-model", model,
                 "--decode", "0", "-1", "--max-chars", "80"]) == 0
    out = capsys.readouterr().out
    first_text = json.loads(open(corpus / "valid.jsonl").readline())["text"]
    assert f"documents  {n_docs:,}" in out and f"tokens     {ds.num_tokens:,}" in out
    assert "length histogram" in out and first_text[:80] in out and "--- document " + str(n_docs - 1) in out

    assert main(["merge", "--inputs", str(tmp_path / "v_text_document"), str(tmp_path / "v_text_document"),
                 "--output-prefix", str(tmp_path / "vv")]) == 0
    merged = IndexedDataset(tmp_path / "vv")
    assert merged.num_documents == 2 * n_docs
    np.testing.assert_array_equal(merged.tokens[: ds.num_tokens], ds.tokens)
    np.testing.assert_array_equal(merged.tokens[ds.num_tokens :], ds.tokens)


def _error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "missing.idx: no such file" in _error_line(capsys)

    with IndexedWriter(tmp_path / "a", np.uint16) as w:
        w.add_document(np.arange(3))
    with IndexedWriter(tmp_path / "b", np.int32) as w:
        w.add_document(np.arange(3))
    assert main(["merge", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix",
                 str(tmp_path / "c")]) == 2
    assert "different token dtypes" in _error_line(capsys)
    assert not os.path.exists(tmp_path / "c.idx")

    assert main(["merge", "--inputs", str(tmp_path / "a"), "--output-prefix", str(tmp_path / "a")]) == 2
    assert "the output is also an input" in _error_line(capsys)

    with open(tmp_path / "a.bin", "ab") as f:
        f.write(b"\1\2")
    assert main(["inspect", str(tmp_path / "a")]) == 2
    assert "disagree" in _error_line(capsys)

    assert main(["preprocess", "--input", str(tmp_path / "none.jsonl"), "--tokenizer-model", "x.model",
                 "--output-prefix", str(tmp_path / "o")]) == 2
    assert "nothing matched" in _error_line(capsys)

    (tmp_path / "t.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "bad.model").write_bytes(b"not a model")
    assert main(["preprocess", "--input", str(tmp_path / "t.jsonl"), "--tokenizer-model",
                 str(tmp_path / "bad.model"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "bad.model" in _error_line(capsys)

    assert main(["train-tokenizer", "--input", str(tmp_path / "t.jsonl"), "--vocab-size", "100000",
                 "--output-prefix", str(tmp_path / "big")]) == 2
    assert "vocab" in _error_line(capsys)
    assert not os.path.exists(tmp_path / "big.model")


def test_console_script_is_installed_or_module_runs():
    r = subprocess.run([sys.executable, "-m", "data_tools.cli", "preprocess", "--help"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0 and "--json-keys" in r.stdout and "--append-eod" in r.stdout
