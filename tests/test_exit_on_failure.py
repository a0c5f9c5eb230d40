"""A failing step ends the program: `pretrain train` whose compiled step raises, with data-loader
workers running and work left in inductor's compile pools (a thread pool the interpreter's exit
joins, a sidecar process its atexit handler waits for), exits non-zero with the traceback on stderr
within seconds of the exception, and leaves no worker process behind. (On an H100 such a run printed
its traceback and was still alive when a 120 s limit killed it.)"""
import glob
import os
import subprocess
import sys
import threading
import time

import fault_model
from trainer_helpers import tiny_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _processes_mentioning(*needles: str) -> list[str]:
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in needles):
            found.append(f"{path.split('/')[2]}: {cmd[:200]}")
    return found


def test_a_failing_compiled_step_exits_promptly_with_its_traceback(tmp_path, corpus):
    over = tiny_overrides(tmp_path, corpus, **{
        "model.arch": fault_model.NAME, "model.raise_steps": "[2]", "model.busy_compile_s": 600,
        "train.compile": "true", "data.num_workers": 2, "train.max_steps": 4, "train.eval_every": 0,
        "checkpoint.every": 0})
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHINDUCTOR_COMPILE_THREADS="2")  # the pools exist on any CPU
    proc = subprocess.Popen([sys.executable, os.path.join(TESTS, "fault_model.py"), "train", "baseline/tiny", *over],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
    raised, lines = threading.Event(), {"out": [], "err": []}
    raised_at = []

    def read(stream, name):
        for line in stream:
            lines[name].append(line)
            if line.startswith("fault_model: raising"):  # printed just before the exception
                raised_at.append(time.monotonic())
                raised.set()

    readers = [threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True)]
    for r in readers:
        r.start()
    try:
        raised.wait(timeout=300)  # start-up and compilation
        code = proc.wait(timeout=60)
        exited_at = time.monotonic()
    except subprocess.TimeoutExpired:
        code, exited_at = None, time.monotonic()
    finally:
        if proc.poll() is None:  # still alive: the failure this test is about
            proc.kill()
            proc.wait()
    for r in readers:
        r.join(timeout=10)
    out = "".join(lines["out"])
    stderr = "".join(lines["err"])
    assert raised_at, stderr[-3000:]
    assert code == 1, f"exit code {code} ({exited_at - raised_at[0]:.0f} s after the exception)\n" + stderr[-3000:]
    assert exited_at - raised_at[0] < 10, f"exited {exited_at - raised_at[0]:.1f} s after the exception"
    assert "Traceback (most recent call last)" in stderr and "in _optimizer_step" in stderr
    assert stderr.rstrip().splitlines()[-1].startswith("RuntimeError: injected failure in the backward of step 2")
    assert "step 1/4" in out and "step 2/4" not in out
    # the loader's workers (forks: the run directory is in their command line) and the compile
    # workers (--parent=<pid>) end with it
    deadline = time.monotonic() + 15
    needles = (str(tmp_path / "run"), f"--parent={proc.pid} ")
    while (left := _processes_mentioning(*needles)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
