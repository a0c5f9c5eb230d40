"""Tests for data_tools/tokenizer.py. Every tokenizer is built here from text the test writes
(CPython's own pydoc topics), nothing is downloaded."""
from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from pydoc_data.topics import topics

from data_tools.tokenizer import (HFTokenizer, SentencePieceTokenizer, Tokenizer, _split_long,
                                  _vocab_text, load_tokenizer, train_sentencepiece)

DOCS = [topics[k] for k in sorted(topics)][:12]  # ~1,500 lines of English prose and code
NON_ASCII = "naïve café — Grüße, 日本語のテキスト, emoji 🙂, Ελληνικά"
SAMPLE = DOCS[3][:600] + "\n\n    indented  code(x)\t# tab\n" + NON_ASCII


def _train(tmp_path: Path, name: str = "tok", model_type: str = "bpe", **kw) -> str:
    kw.setdefault("vocab_size", 600)
    return train_sentencepiece(DOCS, tmp_path / name, model_type=model_type, **kw)


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def sp_model(request, tmp_path_factory) -> str:
    return _train(tmp_path_factory.mktemp(request.param), model_type=request.param)


@pytest.fixture(scope="module")
def sp_tok(sp_model) -> Tokenizer:
    return load_tokenizer(sp_model)


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------- sentencepiece training and use

def test_special_ids_fixed(sp_tok):
    assert isinstance(sp_tok, SentencePieceTokenizer)
    assert sp_tok.special_ids() == {"unk": 0, "bos": 1, "eos": 2, "pad": 3, "predict": 4}
    assert sp_tok.eod_id == sp_tok.eos_id == 2
    assert sp_tok.vocab_size == 600
    assert Path(sp_tok.path).with_suffix(".vocab").is_file()
    assert "vocab_size=600" in repr(sp_tok)


def test_round_trip(sp_tok):
    for text in (SAMPLE, DOCS[0], "", "  leading spaces", NON_ASCII):
        ids = sp_tok.encode(text)
        assert sp_tok.decode(ids) == text
        assert sp_tok.unk_id not in ids  # byte fallback covers everything
    assert sp_tok.encode("") == []


def test_byte_fallback_used_for_unseen_characters(sp_tok):
    ids = sp_tok.encode("日本")
    byte_ids = [i for i in ids if 5 <= i < 5 + 256]  # <0x..> byte pieces follow the 5 specials
    assert len(byte_ids) == len("日本".encode()) and len(ids) <= len(byte_ids) + 1  # + maybe "▁"


def test_literal_special_text_is_not_a_special_token(sp_tok):
    text = "before <predict> middle </s> <s> <pad> <unk> after"
    ids = sp_tok.encode(text)
    assert not set(ids) & {0, 1, 2, 3, 4}
    assert sp_tok.decode(ids) == text


@pytest.mark.parametrize("num_threads", [1, 2])
def test_encode_batch_matches_encode(sp_tok, num_threads):
    texts = [SAMPLE, "", NON_ASCII, *DOCS[:4]]
    assert sp_tok.encode_batch(texts, num_threads=num_threads) == [sp_tok.encode(t) for t in texts]
    with pytest.raises(ValueError, match="num_threads"):
        sp_tok.encode_batch(texts, num_threads=0)


def test_fingerprint_pickle_and_numpy_ids(sp_tok):
    import numpy as np

    assert sp_tok.fingerprint() == _sha256(sp_tok.path)
    clone = pickle.loads(pickle.dumps(sp_tok))
    assert clone.encode(SAMPLE) == sp_tok.encode(SAMPLE)
    assert sp_tok.decode(np.array(sp_tok.encode(SAMPLE), dtype=np.uint16)) == SAMPLE


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_training_is_deterministic(tmp_path, model_type):
    a = _train(tmp_path, "a", model_type)
    b = _train(tmp_path, "b", model_type)
    assert Path(a).read_bytes() == Path(b).read_bytes()
    assert Path(a).with_suffix(".vocab").read_bytes() == Path(b).with_suffix(".vocab").read_bytes()


def test_sampling_is_deterministic(tmp_path):
    a = _train(tmp_path, "a", input_sentence_size=300, seed=5, vocab_size=450)
    b = _train(tmp_path, "b", input_sentence_size=300, seed=5, vocab_size=450)
    first = _train(tmp_path, "c", input_sentence_size=300, shuffle_input_sentence=False,
                   vocab_size=450)
    assert Path(a).read_bytes() == Path(b).read_bytes()
    assert load_tokenizer(first).vocab_size == 450


def test_atomic_write_leaves_only_outputs(tmp_path):
    out = tmp_path / "sub" / "tok.model"  # missing directory is created; ".model" suffix accepted
    assert _train(tmp_path / "sub", "tok.model") == str(out)
    assert sorted(os.listdir(tmp_path / "sub")) == ["tok.model", "tok.vocab"]


def test_failure_leaves_nothing_and_keeps_old_model(tmp_path):
    with pytest.raises(ValueError) as err:
        _train(tmp_path, vocab_size=50_000)
    msg = str(err.value)
    assert "lower --vocab-size or give more text" in msg and "\n" not in msg
    assert os.listdir(tmp_path) == []

    good = _train(tmp_path)
    before = Path(good).read_bytes()
    with pytest.raises(ValueError):
        _train(tmp_path, vocab_size=50_000)
    assert Path(good).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["tok.model", "tok.vocab"]


def test_iterator_error_propagates_unchanged(tmp_path):
    def docs():
        yield from DOCS[:3]
        raise KeyError("reader broke")

    with pytest.raises(KeyError, match="reader broke"):
        train_sentencepiece(docs(), tmp_path / "tok", 400)
    assert os.listdir(tmp_path) == []


def test_long_lines_are_split_not_dropped(tmp_path):
    # One document on one line, far longer than max_sentence_length: sentencepiece alone would skip
    # it and find nothing to train on.
    text = " ".join(" ".join(d.split()) for d in DOCS)
    model = train_sentencepiece([text], tmp_path / "tok", 500, max_sentence_length=200)
    tok = load_tokenizer(model)
    assert len(tok.encode("the attribute")) <= 4  # learned real words


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab é日🙂"), max_size=120), st.integers(10, 40))
def test_split_long_pieces_fit(line, max_bytes):
    pieces = list(_split_long(line, max_bytes))
    assert all(0 < len(p.encode()) <= max_bytes and p.strip() for p in pieces)
    # Nothing but separating spaces is lost.
    assert "".join(pieces).replace(" ", "") == line.replace(" ", "")


@pytest.mark.parametrize("kwargs, match", [
    (dict(vocab_size=600, model_type="wordpiece"), "unknown model_type 'wordpiece'"),
    (dict(vocab_size=200), "vocab_size 200 is too small: .*256 byte-fallback pieces"),
    (dict(vocab_size=5, byte_fallback=False), "vocab_size 5 is too small"),
    (dict(vocab_size=263), "cannot hold every character.*raise --vocab-size"),
    (dict(vocab_size=600, character_coverage=0), "character_coverage"),
    (dict(vocab_size=600, max_sentence_length=5), "max_sentence_length"),
    (dict(vocab_size=600, num_threads=0), "num_threads"),
    (dict(vocab_size=600, extra_options={"eos_id": 7}), "may not set eos_id"),
])
def test_training_argument_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        train_sentencepiece(DOCS[:4], tmp_path / "tok", **kwargs)
    assert "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []


def test_no_text_to_train_on(tmp_path):
    with pytest.raises(ValueError, match="no text to train on"):
        train_sentencepiece(["", "\n\n   \n", "\r\n"], tmp_path / "tok", 600)
    with pytest.raises(ValueError, match="no text to train on"):
        train_sentencepiece(iter([]), tmp_path / "tok", 600)


def _raw_sentencepiece(tmp_path, **options) -> str:
    """A model trained with sentencepiece's own defaults, as a foreign tokenizer would be."""
    import sentencepiece as spm

    lines = [ln for d in DOCS[:6] for ln in d.splitlines() if ln.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "raw"),
                                   vocab_size=200, minloglevel=2, **options)
    return str(tmp_path / "raw.model")


def test_foreign_sentencepiece_model_and_overrides(tmp_path):
    import sentencepiece as spm

    model = _raw_sentencepiece(tmp_path)
    # The .vocab train_sentencepiece writes is byte for byte what sentencepiece itself writes.
    expected = (tmp_path / "raw.vocab").read_text(encoding="utf-8")
    assert _vocab_text(spm.SentencePieceProcessor(model_file=model)) == expected
    (tmp_path / "raw.vocab").unlink()
    tok = load_tokenizer(tmp_path)  # directory holding one *.model
    assert tok.special_ids() == {"unk": 0, "bos": 1, "eos": 2, "pad": None, "predict": None}
    tok = load_tokenizer(model, eos_token="<s>", predict_token="</s>")
    assert (tok.eos_id, tok.eod_id, tok.predict_id) == (1, 1, 2)
    with pytest.raises(ValueError, match="no token '<nope>'"):
        load_tokenizer(model, pad_token="<nope>")


def test_sentencepiece_model_without_eos(tmp_path):
    model = _raw_sentencepiece(tmp_path, eos_id=-1)
    with pytest.raises(ValueError, match="no end-of-document token.*eos_token="):
        load_tokenizer(model)
    assert load_tokenizer(model, eos_token="<s>").eos_id == 1


# ---------------------------------------------------------------- Hugging Face tokenizer.json

def _hf_tokenizer(path: Path, specials: list[str], post_eos: bool = False) -> Path:
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, processors, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS[:6], trainer)
    if post_eos:  # a post-processor that appends eos: encode must not run it
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {specials[0]}", special_tokens=[(specials[0], tok.token_to_id(specials[0]))])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory) -> Path:
    return _hf_tokenizer(tmp_path_factory.mktemp("hf") / "tokenizer.json",
                         ["<|endoftext|>", "<pad>"], post_eos=True)


def test_hf_load_file_and_directory(hf_file):
    from tokenizers import Tokenizer as HF

    raw = HF.from_file(str(hf_file))
    for tok in (load_tokenizer(hf_file), load_tokenizer(hf_file.parent)):
        assert isinstance(tok, HFTokenizer)
        assert tok.eos_id == tok.eod_id == raw.token_to_id("<|endoftext|>")
        assert tok.pad_id == raw.token_to_id("<pad>")
        assert (tok.bos_id, tok.predict_id, tok.unk_id) == (None, None, None)
        assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
        assert tok.path == str(hf_file) and tok.fingerprint() == _sha256(hf_file)


def test_hf_encode(hf_file):
    tok = load_tokenizer(hf_file)
    texts = [SAMPLE, "", NON_ASCII, "text with <|endoftext|> inside", *DOCS[:3]]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids and tok.pad_id not in ids  # none added, none forged
    for n in (1, 2):
        assert tok.encode_batch(texts, num_threads=n) == [tok.encode(t) for t in texts]
    clone = pickle.loads(pickle.dumps(tok))  # as sent to preprocessing worker processes
    assert [clone.encode(t) for t in texts] == [tok.encode(t) for t in texts]


def test_hf_overrides(hf_file):
    tok = load_tokenizer(hf_file, eos_token="<pad>", bos_token="<|endoftext|>")
    assert (tok.eos_id, tok.eod_id, tok.bos_id) == (1, 1, 0)
    with pytest.raises(ValueError, match="no token '<nope>'"):
        HFTokenizer(hf_file, eos_token="<nope>")


def test_hf_llama_style_names(tmp_path):
    path = _hf_tokenizer(tmp_path / "tok.json", ["<|begin_of_text|>", "<|end_of_text|>", "<predict>"])
    tok = load_tokenizer(path)
    assert tok.special_ids() == {"unk": None, "bos": 0, "eos": 1, "pad": None, "predict": 2}


def test_hf_without_eos(tmp_path):
    path = _hf_tokenizer(tmp_path / "tokenizer.json", ["<pad>"])
    with pytest.raises(ValueError, match="no end-of-document token.*eos_token=") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert load_tokenizer(path, eos_token="<pad>").eos_id == 0


# ---------------------------------------------------------------- load_tokenizer errors

def test_load_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.model"):
        load_tokenizer(tmp_path / "nothere.model")


@pytest.mark.parametrize("name, content, match", [
    ("x.model", b"garbage \x00\x01 bytes", "x.model: not a sentencepiece model"),
    ("tokenizer.json", b'{"broken": ', "tokenizer.json: not a Hugging Face tokenizer.json"),
    ("vocab.txt", b"a\nb\n", "vocab.txt: unknown tokenizer kind"),
])
def test_load_corrupt_or_unknown_file(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        load_tokenizer(tmp_path / name)
    assert "\n" not in str(err.value)


def test_load_directory_errors(tmp_path, sp_model, hf_file):
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(Path(sp_model).read_bytes())
    (tmp_path / "tokenizer.json").write_bytes(hf_file.read_bytes())
    with pytest.raises(ValueError, match="several tokenizers.*tokenizer.model, tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "other.model").write_bytes(b"ignored: tokenizer.model wins")
    assert load_tokenizer(tmp_path).path == str(tmp_path / "tokenizer.model")


def test_import_is_light():
    code = ("import sys, data_tools.tokenizer; "
            "print([m for m in ('torch', 'datasets', 'sentencepiece', 'tokenizers') if m in sys.modules])")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == "[]"
