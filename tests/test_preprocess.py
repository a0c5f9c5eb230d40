"""`pretrain-data preprocess`: content, determinism across worker counts, every input format, bad
input, atomic outputs and resume after a crash."""
import json
import os

import numpy as np
import pytest

from data_tools import preprocess as pp
from data_tools.indexed import IndexedDataset
from data_tools.preprocess import PreprocessConfig, output_prefix_for, preprocess
from data_tools.sources import InputError
from data_tools.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def texts():
    import pydoc_data.topics as t

    return [t.topics[k] for k in sorted(t.topics)][:120]


@pytest.fixture(scope="session")
def spm(tmp_path_factory, texts):
    from data_tools.tokenizer import train_sentencepiece

    return train_sentencepiece(texts, str(tmp_path_factory.mktemp("tok") / "spm"), 600, num_threads=1)


def _jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r) + "\n")
    return str(path)


def _run(tmp_path, spm, inputs, name="out", **kw):
    kw.setdefault("progress", False)
    cfg = PreprocessConfig(inputs=inputs, output_prefix=str(tmp_path / name), tokenizer=spm, **kw)
    stats = preprocess(cfg, log=lambda *a: None)
    return stats, {k: IndexedDataset(output_prefix_for(cfg.output_prefix, k)) for k in cfg.json_keys}


def _docs(ds):
    starts, lengths = ds.document_token_bounds()
    return [ds.tokens[s : s + n].tolist() for s, n in zip(starts, lengths)]


def test_content_matches_tokenizer_and_workers_do_not_change_bytes(tmp_path, spm, texts):
    src = tmp_path / "in"
    src.mkdir()
    _jsonl(src / "a.jsonl", [{"text": t} for t in texts[:70]])
    _jsonl(src / "b.jsonl", [{"text": t} for t in texts[70:]])
    tok = load_tokenizer(spm)
    expected = [tok.encode(t) + [tok.eod_id] for t in texts]  # files in sorted order, lines in order
    outs = {}
    for workers in (1, 2):
        stats, ds = _run(tmp_path, spm, [str(src)], f"w{workers}", workers=workers, chunk_mb=0.01)
        assert _docs(ds["text"]) == expected
        assert ds["text"].dtype == np.uint16
        assert stats.documents == len(texts) and not stats.skips
        outs[workers] = [open(output_prefix_for(tmp_path / f"w{workers}", "text") + e, "rb").read()
                         for e in (".bin", ".idx")]
    assert outs[1] == outs[2]
    assert not [p for p in os.listdir(tmp_path) if ".parts-" in p or ".tmp" in p]


def test_megatron_reads_preprocessed_output(tmp_path, spm, texts, megatron_indexed):
    _, ds = _run(tmp_path, spm, [_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:20]])])
    theirs = megatron_indexed.IndexedDataset(output_prefix_for(tmp_path / "out", "text"))
    assert len(theirs) == 20
    for i, doc in enumerate(_docs(ds["text"])):
        assert theirs[i].tolist() == doc


def test_bad_records_are_counted_and_reported(tmp_path, spm, texts):
    path = tmp_path / "bad.jsonl"
    with open(path, "wb") as f:
        f.write((json.dumps({"text": texts[0]}) + "\n").encode())
        f.write(b'{"text": "unterminated\n')
        f.write(b'{"body": "no text key"}\n')
        f.write(b'{"text": "\xff\xfe invalid utf-8"}\n')
        f.write(b'{"text": "   "}\n')
        f.write(b'{"text": 17}\n')
        f.write(b'["not", "an", "object"]\n')
        f.write(b"\n")  # a blank line is not a record
        f.write((json.dumps({"text": texts[1]}) + "\n").encode())
    stats, ds = _run(tmp_path, spm, [str(path)])
    assert stats.documents == 2 and ds["text"].num_documents == 2
    assert stats.skips == {"malformed JSON": 1, "missing key 'text'": 1,
                           "invalid UTF-8": 1, "empty document": 1, "key 'text' is not a string": 1,
                           "record is not a JSON object": 1}
    assert stats.examples["missing key 'text'"] == [f"{path}@byte{len(json.dumps({'text': texts[0]})) + 24}"]
    summary = pp._skip_summary(stats)
    assert "skipped 6 record(s)" in summary and "invalid UTF-8" in summary


def test_strict_stops_at_first_bad_record(tmp_path, spm):
    path = _jsonl(tmp_path / "s.jsonl", [{"text": "fine"}, '{"text": oops}\n'])
    with pytest.raises(InputError, match=r"s\.jsonl@byte\d+ \(Expecting value\): malformed JSON \(--strict\)"):
        _run(tmp_path, spm, [path], strict=True, workers=1)
    assert not os.path.exists(output_prefix_for(tmp_path / "out", "text") + ".idx")


def test_all_records_bad_is_an_error(tmp_path, spm):
    path = _jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"x": "y"}])
    with pytest.raises(InputError, match="no usable documents"):
        _run(tmp_path, spm, [path], workers=1)


def test_several_keys_give_several_outputs(tmp_path, spm, texts):
    path = _jsonl(tmp_path / "k.jsonl", [{"title": t[:30], "text": t} for t in texts[:10]])
    _, ds = _run(tmp_path, spm, [path], json_keys=("title", "text"), workers=1)
    tok = load_tokenizer(spm)
    assert _docs(ds["title"]) == [tok.encode(t[:30]) + [tok.eod_id] for t in texts[:10]]
    assert _docs(ds["text"])[3] == tok.encode(texts[3]) + [tok.eod_id]


def test_no_eod_and_int32(tmp_path, spm, texts):
    path = _jsonl(tmp_path / "n.jsonl", [{"text": t} for t in texts[:5]])
    _, ds = _run(tmp_path, spm, [path], append_eod=False, dtype="int32", workers=1)
    tok = load_tokenizer(spm)
    assert ds["text"].dtype == np.int32
    assert _docs(ds["text"]) == [tok.encode(t) for t in texts[:5]]


def test_text_files_parquet_and_datasets_folder(tmp_path, spm, texts):
    tok = load_tokenizer(spm)
    expected = [tok.encode(t) + [tok.eod_id] for t in texts[:6]]
    tdir = tmp_path / "txt"
    tdir.mkdir()
    for i, t in enumerate(texts[:6]):
        (tdir / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    _, ds = _run(tmp_path, spm, [str(tdir)], "t", workers=1)
    assert _docs(ds["text"]) == expected

    lines = tmp_path / "lines.txt"
    lines.write_text("first line\n\nsecond line\n", encoding="utf-8")
    _, ds = _run(tmp_path, spm, [str(lines)], "l", text_unit="line", workers=1)
    assert _docs(ds["text"]) == [tok.encode(x) + [tok.eod_id] for x in ("first line", "second line")]

    pa = pytest.importorskip("pyarrow", reason="parquet input needs pyarrow (the formats extra)")
    import pyarrow.parquet as pq

    table = pa.table({"text": texts[:6], "id": list(range(6))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    _, ds = _run(tmp_path, spm, [str(tmp_path / "d.parquet")], "p", workers=2)
    assert _docs(ds["text"]) == expected

    datasets = pytest.importorskip("datasets", reason="save_to_disk input needs datasets (the formats extra)")
    datasets.Dataset.from_dict({"text": texts[:6]}).save_to_disk(str(tmp_path / "hf"))
    _, ds = _run(tmp_path, spm, [str(tmp_path / "hf")], "h", workers=1)
    assert _docs(ds["text"]) == expected


def test_existing_output_is_not_overwritten(tmp_path, spm):
    path = _jsonl(tmp_path / "o.jsonl", [{"text": "some text"}])
    _run(tmp_path, spm, [path], workers=1)
    before = open(output_prefix_for(tmp_path / "out", "text") + ".idx", "rb").read()
    with pytest.raises(InputError, match="already exists; pass --overwrite"):
        _run(tmp_path, spm, [path], workers=1)
    assert open(output_prefix_for(tmp_path / "out", "text") + ".idx", "rb").read() == before
    _run(tmp_path, spm, [path], workers=1, overwrite=True)


def test_missing_input_is_one_clear_error(tmp_path, spm):
    with pytest.raises(InputError, match="nothing matched"):
        _run(tmp_path, spm, [str(tmp_path / "nope*.jsonl")])


def test_crash_keeps_finished_partitions_and_resume_matches(tmp_path, spm, texts, monkeypatch):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(4):
        _jsonl(src / f"{i}.jsonl", [{"text": t} for t in texts[i * 25 : (i + 1) * 25]])
    kw = dict(workers=1, chunk_mb=0.02, partition_mb=0.05)
    _run(tmp_path, spm, [str(src)], "ref", **kw)

    calls = []
    real = pp.encode_chunk

    def dying(chunk):
        calls.append(chunk)
        if len(calls) == 5:
            raise RuntimeError("worker died")
        return real(chunk)

    monkeypatch.setattr(pp, "encode_chunk", dying)
    with pytest.raises(RuntimeError, match="worker died"):
        _run(tmp_path, spm, [str(src)], "out", **kw)
    final = output_prefix_for(tmp_path / "out", "text")
    assert not os.path.exists(final + ".idx") and not os.path.exists(final + ".bin")
    parts_dir = [p for p in os.listdir(tmp_path) if p.startswith("out.parts-")]
    assert len(parts_dir) == 1
    done = sorted(p for p in os.listdir(tmp_path / parts_dir[0]) if p.endswith(".done.json"))
    assert done and not [p for p in os.listdir(tmp_path / parts_dir[0]) if ".tmp" in p]

    calls.clear()
    monkeypatch.setattr(pp, "encode_chunk", lambda c: (calls.append(c), real(c))[1])
    stats, _ = _run(tmp_path, spm, [str(src)], "out", **kw)
    assert stats.documents == len(texts[:100])  # totals include the partitions done before the crash
    n_chunks = len(pp.plan_chunks(pp.expand_inputs([str(src)]), int(0.02 * 2**20)))
    assert len(calls) < n_chunks  # finished partitions were not encoded again
    for e in (".bin", ".idx"):
        assert open(final + e, "rb").read() == open(output_prefix_for(tmp_path / "ref", "text") + e, "rb").read()
    assert not [p for p in os.listdir(tmp_path) if ".parts-" in p]
