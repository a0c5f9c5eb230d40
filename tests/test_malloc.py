"""The caching-allocator re-exec of `pretrain train` (pretrain/malloc.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pretrain import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def execs(monkeypatch):
    """Record os.execve calls instead of replacing the test process."""
    calls = []
    monkeypatch.setattr(malloc.os, "execve", lambda exe, args, env: calls.append((exe, args, env)))
    for key in (malloc.ENV, malloc._DONE, "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(malloc.sys, "platform", "linux")
    return calls


def test_reexec_preloads_the_found_library_once(execs, monkeypatch):
    monkeypatch.setattr(malloc, "find_caching_allocator", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    argv = ["/venv/bin/python", "-u", "-m", "pretrain.cli", "train", "baseline/tiny", "optim.lr=1e-3"]
    malloc.use_caching_allocator(argv)
    [(exe, args, env)] = execs
    assert exe == sys.executable and args == [sys.executable, *argv[1:]]
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libother.so" and env[malloc._DONE] == "1"
    # the re-executed process does not exec again, whatever LD_PRELOAD says
    monkeypatch.setenv(malloc._DONE, "1")
    malloc.use_caching_allocator(argv)
    assert len(execs) == 1


def test_no_reexec_when_disabled_preloaded_or_missing(execs, monkeypatch):
    monkeypatch.setattr(malloc, "find_caching_allocator", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setenv(malloc.ENV, "system")
    malloc.use_caching_allocator(["python", "x"])
    monkeypatch.setenv(malloc.ENV, "auto")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert malloc.active_allocator() == "libjemalloc.so.2"
    malloc.use_caching_allocator(["python", "x"])
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setattr(malloc, "find_caching_allocator", lambda: None)
    malloc.use_caching_allocator(["python", "x"])
    assert execs == []
    assert "install libtcmalloc-minimal4" in malloc.allocator_note()


def test_explicit_library_path_must_exist(execs, monkeypatch, tmp_path):
    monkeypatch.setenv(malloc.ENV, str(tmp_path / "nope.so"))
    with pytest.raises(SystemExit, match="PRETRAIN_MALLOC=.*nope.so: no such library"):
        malloc.use_caching_allocator(["python", "x"])
    assert execs == []


def test_train_runs_under_the_caching_allocator(tmp_path):
    if malloc.find_caching_allocator() is None:  # the test command installs it (scripts/test.sh)
        pytest.fail("neither tcmalloc nor jemalloc is installed: apt-get install libtcmalloc-minimal4")
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.ENV, malloc._DONE)}
    env["PYTHONPATH"] = ROOT
    logs = {}
    for name, choice in (("auto", "auto"), ("system", "system")):
        over = tiny_overrides(tmp_path / name, corpus, **{"train.max_steps": 2, "schedule.warmup_steps": 0, "train.eval_every": 0,
                                                           "checkpoint.every": 0})
        out = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny", *over],
                             capture_output=True, text=True, timeout=300, env={**env, malloc.ENV: choice})
        assert out.returncode == 0, out.stderr[-2000:]
        logs[name] = out.stdout + out.stderr
    assert f"malloc: {os.path.basename(malloc.find_caching_allocator())}" in logs["auto"]
    assert "malloc: system malloc" in logs["system"]
