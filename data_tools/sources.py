"""Where documents come from: jsonl, plain text, parquet and `datasets` folders saved on local disk.

Input is planned as a list of `Chunk`s (byte ranges of a jsonl file, groups of text files, parquet row
groups, record batches of an arrow shard) so that workers can read them independently and the output
order is the same whatever the number of workers. Reading a chunk yields `(where, fields)` pairs, or
a `Skip` for a record that cannot be used (malformed JSON, a missing key, invalid UTF-8, an empty
document); the caller counts skips and reports them at the end. Nothing here imports torch or
`datasets`; pyarrow is imported only for parquet and arrow inputs.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterator

JSONL_EXT = (".jsonl", ".json", ".ndjson")
TEXT_EXT = (".txt", ".text", ".md", ".rst")
PARQUET_EXT = (".parquet",)
FORMATS = ("jsonl", "text", "parquet", "hf")
TEXT_UNITS = ("file", "line")


class InputError(ValueError):
    """An input path or format problem that stops the run; the message is one line."""


@dataclass(frozen=True)
class Chunk:
    """A unit of reading work: `path` (or several for text files) and a range inside it."""

    fmt: str
    paths: tuple[str, ...]
    start: int = 0  # byte offset (jsonl / text lines), row group or record batch index
    stop: int = 0
    nbytes: int = 0  # approximate input bytes, for progress


@dataclass(frozen=True)
class Skip:
    reason: str
    where: str


def detect_format(path: str) -> str:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(
            os.path.join(path, "dataset_dict.json")
        ):
            return "hf"
        raise InputError(f"{path}: a directory that is not a `datasets` save_to_disk folder")
    low = path.lower()
    if low.endswith(JSONL_EXT):
        return "jsonl"
    if low.endswith(TEXT_EXT):
        return "text"
    if low.endswith(PARQUET_EXT):
        return "parquet"
    raise InputError(
        f"{path}: cannot tell the format from the name; use --input-format {{{','.join(FORMATS)}}}"
    )


def expand_inputs(patterns: list[str], input_format: str | None = None) -> list[tuple[str, str]]:
    """Files, globs and directories -> sorted (path, format) pairs; directories are searched
    recursively for known extensions unless they are `datasets` folders themselves."""
    found: list[tuple[str, str]] = []
    for pat in patterns:
        matches = sorted(glob.glob(pat, recursive=True)) if glob.has_magic(pat) else [pat]
        if not matches or not any(os.path.exists(m) for m in matches):
            raise InputError(f"{pat}: no such file or directory (nothing matched)")
        for m in matches:
            if os.path.isdir(m) and input_format != "hf" and detect_format_safe(m) != "hf":
                inner = sorted(
                    os.path.join(root, f)
                    for root, _, files in os.walk(m)
                    for f in files
                    if input_format or f.lower().endswith(JSONL_EXT + TEXT_EXT + PARQUET_EXT)
                )
                if not inner:
                    raise InputError(f"{m}: directory holds no .jsonl, .txt or .parquet files")
                found += [(p, input_format or detect_format(p)) for p in inner]
            else:
                found.append((m, input_format or detect_format(m)))
    seen, unique = set(), []
    for p, f in found:  # the same file named twice would silently double its weight
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            unique.append((p, f))
    return unique


def detect_format_safe(path: str) -> str | None:
    try:
        return detect_format(path)
    except InputError:
        return None


# -- planning ----------------------------------------------------------------------------------
def plan_chunks(inputs: list[tuple[str, str]], chunk_bytes: int, text_unit: str = "file") -> list[Chunk]:
    chunks: list[Chunk] = []
    text_group: list[str] = []
    group_bytes = 0

    def flush_text_group():
        nonlocal text_group, group_bytes
        if text_group:
            chunks.append(Chunk("text-files", tuple(text_group), nbytes=group_bytes))
            text_group, group_bytes = [], 0

    for path, fmt in inputs:
        if fmt == "text" and text_unit == "file":
            size = os.path.getsize(path)
            text_group.append(path)
            group_bytes += size
            if group_bytes >= chunk_bytes:
                flush_text_group()
            continue
        flush_text_group()
        if fmt in ("jsonl", "text"):
            size = os.path.getsize(path)
            kind = "jsonl" if fmt == "jsonl" else "text-lines"
            for a in range(0, max(size, 1), chunk_bytes):
                chunks.append(Chunk(kind, (path,), a, min(a + chunk_bytes, size), min(chunk_bytes, size - a)))
        elif fmt == "parquet":
            chunks += _plan_parquet(path)
        elif fmt == "hf":
            chunks += _plan_arrow_dir(path, chunk_bytes)
        else:
            raise InputError(f"{path}: unknown format {fmt!r}")
    flush_text_group()
    return chunks


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise InputError(f"parquet and `datasets` inputs need pyarrow ({e}); pip install pyarrow") from e
    return pyarrow


def _plan_parquet(path: str) -> list[Chunk]:
    pa = _pyarrow()
    try:
        meta = pa.parquet.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises several types for a bad file
        raise InputError(f"{path}: not a readable parquet file ({e})") from e
    out = []
    for g in range(meta.num_row_groups):
        out.append(Chunk("parquet", (path,), g, g + 1, meta.row_group(g).total_byte_size))
    return out


def arrow_files(path: str, split: str | None = None) -> list[str]:
    """The arrow shards of a `save_to_disk` folder (a Dataset, or one split of a DatasetDict)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        split = split or ("train" if "train" in splits else (splits[0] if splits else None))
        if split not in splits:
            raise InputError(f"{path}: has splits {splits}, not {split!r}")
        path = os.path.join(path, split)
    state_file = os.path.join(path, "state.json")
    try:
        with open(state_file) as f:
            state = json.load(f)
        return [os.path.join(path, d["filename"]) for d in state["_data_files"]]
    except (OSError, KeyError, ValueError) as e:
        raise InputError(f"{state_file}: not a readable `datasets` state file ({e})") from e


def _open_arrow(path: str):
    pa = _pyarrow()
    try:
        return pa.ipc.open_stream(pa.memory_map(path, "r"))
    except Exception as e:
        raise InputError(f"{path}: not a readable arrow stream ({e})") from e


def _plan_arrow_dir(path: str, chunk_bytes: int) -> list[Chunk]:
    out = []
    for shard in arrow_files(path):
        reader = _open_arrow(shard)
        start, acc, n = 0, 0, 0
        for n, batch in enumerate(reader, start=1):
            acc += batch.nbytes
            if acc >= chunk_bytes:
                out.append(Chunk("arrow", (shard,), start, n, acc))
                start, acc = n, 0
        if n > start:
            out.append(Chunk("arrow", (shard,), start, n, acc))
    return out


# -- reading -----------------------------------------------------------------------------------
def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _fields(record, keys: tuple[str, ...], where: str):
    """Pick the text fields of a record, or a Skip saying why the record is unusable."""
    if not isinstance(record, dict):
        return Skip("record is not a JSON object", where)
    out = {}
    for k in keys:
        v = record.get(k)
        if v is None:
            return Skip(f"missing key {k!r}", where)
        if not isinstance(v, str):
            return Skip(f"key {k!r} is not a string", where)
        if not v.strip():
            return Skip("empty document", where)
        out[k] = v
    return out


def _byte_range_lines(path: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """Lines whose first byte lies in [start, stop), with their byte offsets."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line that began before `start` belongs to the previous chunk
        pos = f.tell()
        while pos < stop:
            line = f.readline()
            if not line:
                break
            yield pos, line
            pos += len(line)


def read_chunk(chunk: Chunk, keys: tuple[str, ...]) -> Iterator[tuple[str, dict] | Skip]:
    """Yield (where, {key: text}) for every usable record of the chunk, Skip for the rest."""
    if chunk.fmt == "jsonl":
        path = chunk.paths[0]
        for pos, raw in _byte_range_lines(path, chunk.start, chunk.stop):
            where = f"{path}@byte{pos}"
            if not raw.strip():
                continue  # blank lines are not records
            text = _decode(raw)
            if text is None:
                yield Skip("invalid UTF-8", where)
                continue
            try:
                record = json.loads(text)
            except ValueError as e:
                yield Skip("malformed JSON", f"{where} ({str(e).split(':')[0]})")
                continue
            f = _fields(record, keys, where)
            yield f if isinstance(f, Skip) else (where, f)
    elif chunk.fmt == "text-lines":
        path = chunk.paths[0]
        for pos, raw in _byte_range_lines(path, chunk.start, chunk.stop):
            where = f"{path}@byte{pos}"
            text = _decode(raw)
            if text is None:
                yield Skip("invalid UTF-8", where)
            elif text.strip():
                yield where, {k: text.rstrip("\n") for k in keys}
            # a blank line in line mode is a separator, not an empty document
    elif chunk.fmt == "text-files":
        for path in chunk.paths:
            with open(path, "rb") as f:
                text = _decode(f.read())
            if text is None:
                yield Skip("invalid UTF-8", path)
            elif not text.strip():
                yield Skip("empty document", path)
            else:
                yield path, {k: text for k in keys}
    elif chunk.fmt in ("parquet", "arrow"):
        yield from _read_columnar(chunk, keys)
    else:
        raise InputError(f"unknown chunk kind {chunk.fmt!r}")


def _read_columnar(chunk: Chunk, keys: tuple[str, ...]):
    path = chunk.paths[0]
    if chunk.fmt == "parquet":
        pf = _pyarrow().parquet.ParquetFile(path)
        names = set(pf.schema_arrow.names)
        missing = [k for k in keys if k not in names]
        if missing:
            raise InputError(f"{path}: no column {missing[0]!r} (columns: {sorted(names)})")
        batches = [pf.read_row_group(chunk.start, columns=list(keys))]
    else:
        reader = _open_arrow(path)
        names = set(reader.schema.names)
        missing = [k for k in keys if k not in names]
        if missing:
            raise InputError(f"{path}: no column {missing[0]!r} (columns: {sorted(names)})")
        batches = [b for i, b in enumerate(reader) if chunk.start <= i < chunk.stop]
    row = 0
    for b in batches:
        cols = {k: b.column(k).to_pylist() for k in keys}
        for i in range(b.num_rows):
            where = f"{path}@{'rowgroup' if chunk.fmt == 'parquet' else 'batch'}{chunk.start}+row{row}"
            row += 1
            f = _fields({k: cols[k][i] for k in keys}, keys, where)
            yield f if isinstance(f, Skip) else (where, f)


def iter_texts(patterns: list[str], key: str = "text", input_format: str | None = None,
               text_unit: str = "file") -> Iterator[str]:
    """Stream every usable text of the inputs (for tokenizer training); skips are dropped."""
    inputs = expand_inputs(patterns, input_format)
    for chunk in plan_chunks(inputs, 16 << 20, text_unit):
        for item in read_chunk(chunk, (key,)):
            if not isinstance(item, Skip):
                yield item[1][key]
