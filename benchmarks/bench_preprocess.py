"""Preprocessing throughput against the tokenizer's own batch encoding, measured side by side.

    python benchmarks/bench_preprocess.py [--workdir /tmp/pretrain-bench] [--workers 2]

Corpus: every text file of Debian's `linux-doc-6.1` package (reStructuredText, plain text, YAML and
the rendered HTML; gzip-compressed files are unpacked), one document per file, as jsonl: about
170 MB. The package is installed with apt-get when it is missing (pass --no-install to refuse).

Baseline: the same texts held in memory, encoded by `Tokenizer.encode_batch(texts, num_threads=2)`
(sentencepiece's C++ thread pool): the raw speed of the tokenizer on this machine. It is measured
before and after the preprocessing run and averaged, so drift in machine load shows up as a spread.

Preprocessing: `pretrain-data preprocess --workers 2` started as a new process. End to end is the
wall time of that process, from its start (interpreter start-up and imports included) to its exit
(outputs published). Steady state is the token rate between the chunks that complete the 10% and
90% marks of the run's tokens. Rates are tokenizer tokens per second, end-of-document tokens
excluded, so both sides count exactly the same tokens.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from procmem import status_kib  # noqa: E402  (benchmarks/, this script's folder)

DOC_DIR = "/usr/share/doc/linux-doc-6.1"
TEXT_SUFFIXES = (".rst", ".txt", ".yaml", ".html", ".py", ".c", ".h", ".sh", ".json", ".tex")


def ensure_package(install: bool) -> None:
    if os.path.isdir(DOC_DIR):
        return
    if not install:
        sys.exit(f"{DOC_DIR} is missing; install Debian's linux-doc-6.1 or drop --no-install")
    print("installing Debian's linux-doc-6.1 (about 37 MB download) ...", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "linux-doc-6.1"], check=True, env=env)


def build_corpus(path: str) -> None:
    if os.path.isfile(path):
        return
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(DOC_DIR) for f in fs)
    n = 0
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        for p in files:
            name = p[:-3] if p.endswith(".gz") else p
            if not name.endswith(TEXT_SUFFIXES):
                continue
            raw = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                out.write(json.dumps({"text": text, "path": os.path.relpath(name, DOC_DIR)}) + "\n")
                n += 1
    os.replace(path + ".tmp", path)
    print(f"corpus: {n:,} documents, {os.path.getsize(path) / 1e6:.1f} MB of jsonl -> {path}")


def _rss_mb(pid: int) -> int:
    try:
        return status_kib("VmRSS", pid) >> 10
    except OSError:  # the process has just exited
        return 0


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def watch_memory(proc: subprocess.Popen, interval: float = 0.05) -> tuple[int, int]:
    """Wait for `proc`, sampling the resident memory of it and of its worker processes (Linux /proc).
    (ru_maxrss of children is no use here: it counts the benchmark's own memory at fork time.)"""
    main = worker = 0
    while proc.poll() is None:
        main = max(main, _rss_mb(proc.pid))
        worker = max([worker] + [_rss_mb(c) for c in _children(proc.pid)])
        time.sleep(interval)
    return main, worker


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "data_tools.cli", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/pretrain-bench")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of the raw batch-encoding baseline")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--no-install", dest="install", action="store_false")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    ensure_package(args.install)
    corpus = os.path.join(args.workdir, "linuxdoc.jsonl")
    build_corpus(corpus)
    model = os.path.join(args.workdir, f"spm_bpe{args.vocab_size}.model")
    if not os.path.isfile(model):
        subprocess.run(cli("train-tokenizer", "--input", corpus, "--vocab-size", str(args.vocab_size),
                           "--output-prefix", model[:-6], "--max-sentences", "300000"), check=True, env=env)

    from data_tools.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"corpus {len(texts):,} documents, {mb:.1f} MB of text; tokenizer {model} (vocab {tok.vocab_size})")

    def raw_rate() -> tuple[float, int]:
        t0 = time.perf_counter()
        ids = tok.encode_batch(texts, num_threads=args.threads)
        dt = time.perf_counter() - t0
        n = sum(map(len, ids))
        return n / dt, n

    raw1, n_raw = raw_rate()
    print(f"raw encode_batch, {args.threads} threads:   {raw1:,.0f} tok/s ({n_raw:,} tokens)", flush=True)

    out = os.path.join(args.workdir, "out")
    stats_file = os.path.join(args.workdir, "stats.json")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cli("preprocess", "--input", corpus, "--tokenizer-model", model, "--output-prefix", out,
                                "--workers", str(args.workers), "--overwrite", "--no-progress",
                                "--stats-json", stats_file), env=env)
    peak_main_mb, peak_worker_mb = watch_memory(proc)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"preprocess failed with exit code {proc.returncode}")
    with open(stats_file) as f:
        st = json.load(f)
    raw2, _ = raw_rate()
    print(f"raw encode_batch again:         {raw2:,.0f} tok/s", flush=True)

    if st["text_tokens"] != n_raw:
        sys.exit(f"MISMATCH: preprocessing produced {st['text_tokens']:,} tokens, raw encoding {n_raw:,}")
    tl = st["timeline"]  # (seconds since the pool started, tokens of the chunk, bytes), in output order
    cum, t_at = 0, []
    for t, n, _ in tl:
        cum += n
        t_at.append((t, cum))
    lo = next(x for x in t_at if x[1] >= 0.1 * cum)
    hi = next(x for x in t_at if x[1] >= 0.9 * cum)
    steady = (hi[1] - lo[1]) / (hi[0] - lo[0])
    e2e = n_raw / wall
    raw = (raw1 + raw2) / 2
    print(f"preprocess, {args.workers} workers, steady:   {steady:,.0f} tok/s")
    print(f"preprocess end to end ({wall:.1f} s): {e2e:,.0f} tok/s")
    print(f"peak resident memory: main process {peak_main_mb:,} MB, largest worker {peak_worker_mb:,} MB "
          f"(input {os.path.getsize(corpus) / 1e6:,.0f} MB)")
    print(f"RATIO steady / raw     = {steady / raw:.3f}  (target >= 0.85; raw runs {raw1:,.0f} and {raw2:,.0f})")
    print(f"RATIO end-to-end / raw = {e2e / raw:.3f}  (target >= 0.70)")


if __name__ == "__main__":
    main()
