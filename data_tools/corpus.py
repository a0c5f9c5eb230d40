"""The embedded corpus: English text that every CPython install carries, extracted deterministically.

Two sources, both read from the running interpreter's standard library without importing any of
its modules (importing some has side effects): the help topics of `pydoc_data.topics` and the
docstrings of modules, classes and functions in the standard library's `.py` files, found with
`ast`. Documents come out in a fixed order (sorted paths, source order inside a file), so the same
Python version always yields the same corpus, byte for byte. Nothing is downloaded.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig

from .files import atomic_write

# Test suites and the IDE are mostly code, not prose; site-packages is not the standard library.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
_MIN_CHARS = 200  # shorter docstrings are one-liners that teach a model little


def _topics() -> list[tuple[str, str]]:
    import pydoc_data.topics as t  # a plain dict of strings, safe to import

    return [(f"pydoc:{name}", t.topics[name]) for name in sorted(t.topics)]


def _docstrings(path: str, rel: str) -> list[tuple[str, str]]:
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return []
    out = []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= _MIN_CHARS:
            name = getattr(node, "name", "<module>")
            out.append((f"doc:{rel}:{name}", doc))
    return out


def embedded_documents(max_docs: int | None = None) -> list[tuple[str, str]]:
    """(id, text) pairs: the pydoc help topics, then standard-library docstrings by sorted path."""
    docs = _topics()
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        paths += [os.path.join(root, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        docs += _docstrings(path, os.path.relpath(path, stdlib))
        if max_docs is not None and len(docs) >= max_docs:
            break
    return docs[:max_docs] if max_docs is not None else docs


def write_embedded_corpus(out_dir: str, valid_every: int = 20) -> dict:
    """Write train.jsonl and valid.jsonl (every `valid_every`-th document) into `out_dir`.

    Returns a summary with document counts, characters and a sha256 of the files, so that a run can
    show it used exactly the expected corpus.
    """
    os.makedirs(out_dir, exist_ok=True)
    docs = embedded_documents()
    summary = {}
    h = hashlib.sha256()
    for split in ("train", "valid"):
        keep = [(i, d) for n, (i, d) in enumerate(docs) if (n % valid_every == valid_every - 1) == (split == "valid")]
        path = os.path.join(out_dir, f"{split}.jsonl")
        data = "".join(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n"
                       for doc_id, text in keep).encode("utf-8")
        h.update(data)
        atomic_write(path, data)
        summary[split] = {"path": path, "documents": len(keep), "characters": sum(len(t) for _, t in keep)}
    summary["sha256"] = h.hexdigest()
    return summary
