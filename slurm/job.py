"""The in-job helper of slurm/train.sbatch: what runs before and after the training step.

    eval "$(python -m slurm.job start CONFIG [overrides...])"   # sets RUN_DIR START_STEP HEAD_ADDR PORT ...
    python -m slurm.job end RUN_DIR --rc RC --stopped 0|1 --start-step S   # exit 0 done, 3 requeued, 1 gave up

`start` refuses clearly (one line, exit 2) when: the run directory cannot be written, the job has
ended without progress `max_restarts` times in a row (a requeue loop), or the rendezvous port is
taken on the first node. It records the resolved config and the code's git revision next to the run
(RUN_DIR/slurm/job-<id>.json), and appends to RUN_DIR/slurm/history.jsonl, which `end` reads to tell
a job that makes progress from one that crashes at the same place again and again.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time

EXIT_DONE, EXIT_GAVE_UP, EXIT_BAD, EXIT_REQUEUED = 0, 1, 2, 3


class JobError(RuntimeError):
    """A condition that must stop the job before it trains, in one sentence."""


def rendezvous_port(job_id: str) -> int:
    """The port every node derives from the job id (parallel.dist.default_port: one formula)."""
    from parallel.dist import default_port

    return int(os.environ.get("RDZV_PORT") or default_port(job_id))


def head_address(nodelist: str) -> tuple[str, str]:
    """(first node's name, an address for it): the name if it resolves, else Slurm's NodeAddr."""
    from parallel.dist import expand_hostlist

    head = expand_hostlist(nodelist)[0]
    try:
        socket.getaddrinfo(head, None)
        return head, head
    except socket.gaierror:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", head], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for word in out.split():
        if word.startswith("NodeAddr="):
            return head, word.split("=", 1)[1]
    raise JobError(f"the first node {head!r} does not resolve and scontrol gives no NodeAddr for it")


def check_port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise JobError(f"rendezvous port {port} on {socket.gethostname()} is in use ({e.strerror}); another "
                           "job or service holds it: set RDZV_PORT in the profile's env to a free port") from None


def check_writable(run_dir: str) -> None:
    try:
        os.makedirs(os.path.join(run_dir, "slurm"), exist_ok=True)
        probe = os.path.join(run_dir, "slurm", f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise JobError(f"checkpoint directory {run_dir} is not writable ({e.strerror}); checkpoints could "
                       "not be saved, so the job stops before training") from None


def read_history(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "slurm", "history.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_history(run_dir: str, record: dict) -> None:
    with open(os.path.join(run_dir, "slurm", "history.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def fruitless_ends(history: list[dict]) -> int:
    """Ends in a row, newest first, that neither finished nor advanced the checkpoint."""
    n = 0
    for r in reversed([r for r in history if r.get("event") == "end"]):
        if r["rc"] == 0 or r["end_step"] > r["start_step"]:
            break
        n += 1
    return n


def latest_step(run_dir: str) -> int:
    from pretrain.checkpoint import latest_checkpoint, read_meta

    path = latest_checkpoint(run_dir, log=lambda *_: None)
    return 0 if path is None else int(read_meta(path)["step"])


def planned_steps(run_dir: str) -> float:
    """train.max_steps of the run's stored config (infinite when it cannot be read)."""
    import yaml

    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            return int(yaml.safe_load(f)["train"]["max_steps"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return float("inf")


def git_revision() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
    if rev.returncode:
        return "unknown (not a git checkout)"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def torchrun_grace_note(grace_s: float, option_strings=None) -> str | None:
    """A line for the job's output when this torch's torchrun cannot wait the whole checkpoint grace after
    a stop signal. train.sbatch sets TORCH_ELASTIC_SHUTDOWN_TIMEOUT to the grace plus 30 s; torchruns that
    read it have a --shutdown-timeout option, older ones (torch 2.11's) kill their workers 30 s after SIGTERM."""
    if grace_s <= 30:  # fits in any torchrun's wait: no need to build its parser
        return None
    if option_strings is None:
        from torch.distributed.run import get_args_parser

        option_strings = {s for action in get_args_parser()._actions for s in action.option_strings}
    if "--shutdown-timeout" in option_strings:
        return None
    import torch

    return (f"note: torchrun in torch {torch.__version__} kills its workers 30 s after a stop signal, before "
            f"checkpoint.grace_s={grace_s:g} runs out: a stop checkpoint that takes longer is cut short (the run "
            "resumes from the one before); LAUNCHER=srun waits the whole grace")


def start(config: str, overrides: list[str], max_restarts: int, env=os.environ) -> dict:
    """Checks and records before the training step; returns the shell variables for the script."""
    from pretrain.config import load_config, to_yaml

    job = env.get("SLURM_JOB_ID", "0")
    cfg = load_config(config, overrides, check_data=False)
    run_dir = os.path.abspath(cfg.train.run_dir)
    from pretrain.runlock import refuse_before_start

    refuse_before_start(run_dir, cfg.checkpoint.lock_timeout_s, env)  # before this job writes anything there
    check_writable(run_dir)
    fruitless = fruitless_ends(read_history(run_dir))
    if fruitless >= max_restarts + 1:
        raise JobError(f"requeue loop: the last {fruitless} starts of {run_dir} ended without a new "
                       f"checkpoint (max_restarts={max_restarts}); fix the cause (see {run_dir}/logs and the job "
                       "output), then resubmit")
    head, addr = head_address(env.get("SLURM_JOB_NODELIST") or socket.gethostname())
    port = rendezvous_port(job)
    check_port_free(port)
    step = latest_step(run_dir)
    restart = int(env.get("SLURM_RESTART_COUNT") or 0)
    record = {"event": "start", "job": job, "restart": restart, "start_step": step, "time": time.time(),
              "nodes": env.get("SLURM_JOB_NODELIST", ""), "git": git_revision(), "max_restarts": max_restarts}
    with open(os.path.join(run_dir, "slurm", f"job-{job}-{restart}.json"), "w") as f:
        json.dump({**record, "config": config, "overrides": overrides, "resolved_config": to_yaml(cfg)}, f, indent=1)
    append_history(run_dir, record)
    note = torchrun_grace_note(cfg.checkpoint.grace_s) if env.get("LAUNCHER", "torchrun") == "torchrun" else None
    if note:
        print(note, file=sys.stderr)
    return {"RUN_DIR": run_dir, "START_STEP": step, "HEAD_NODE": head, "HEAD_ADDR": addr, "PORT": port,
            "GRACE_S": int(cfg.checkpoint.grace_s)}


def end(run_dir: str, rc: int, stopped: bool, start_step: int, max_restarts: int, env=os.environ) -> tuple[int, str]:
    """Decide after the training step: (exit code, message). Requeues through scontrol when due."""
    from pretrain.preemption import EXIT_REQUEUE

    job = env.get("SLURM_JOB_ID", "0")
    step = latest_step(run_dir)
    record = {"event": "end", "job": job, "rc": rc, "stopped": stopped, "start_step": start_step, "end_step": step,
              "time": time.time()}
    history = read_history(run_dir) + [record]
    append_history(run_dir, record)
    if rc == 0 and not stopped:
        return EXIT_DONE, f"job {job}: training finished at step {step}"
    if not stopped and rc != EXIT_REQUEUE and step and step >= planned_steps(run_dir):
        # the run is complete; a launcher that fails while shutting down after it (torchrun's agents losing
        # their rendezvous store as the head node's agent exits first) must not requeue a finished run
        return EXIT_DONE, (f"job {job}: training finished at step {step} (the launcher then exited with code {rc}, "
                           "after the run was complete)")
    fruitless = fruitless_ends(history)
    from data_tools.storage import EXIT_STORAGE

    why = (f"stopped by the warning signal at step {step}" if stopped or rc == EXIT_REQUEUE
           else f"stopped by a storage fault (disk full, quota, permissions: see the log; latest checkpoint: step "
                f"{step}, intact)" if rc == EXIT_STORAGE
           else f"training failed with exit code {rc} (latest checkpoint: step {step})")
    if fruitless > max_restarts:
        return EXIT_GAVE_UP, (f"job {job}: {why}; not requeued: {fruitless} starts in a row ended without a new "
                              f"checkpoint (max_restarts={max_restarts}). See {run_dir}/logs")
    res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if res.returncode:
        return EXIT_GAVE_UP, f"job {job}: {why}; scontrol requeue failed: {res.stderr.strip() or res.stdout.strip()}"
    return EXIT_REQUEUED, f"job {job}: {why}; requeued (it resumes from the latest checkpoint)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm.job", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = ap.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("start", help="checks and records before training; prints shell assignments")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--max-restarts", type=int, default=int(os.environ.get("MAX_RESTARTS", 3)))
    e = verbs.add_parser("end", help="after training: finished, requeue, or give up")
    e.add_argument("run_dir")
    e.add_argument("--rc", type=int, required=True)
    e.add_argument("--stopped", type=int, default=0)
    e.add_argument("--start-step", type=int, required=True)
    e.add_argument("--max-restarts", type=int, default=int(os.environ.get("MAX_RESTARTS", 3)))
    args = ap.parse_args(argv)
    try:
        if args.verb == "start":
            for key, value in start(args.config, args.overrides, args.max_restarts).items():
                print(f"{key}={shlex.quote(str(value))}")
            return 0
        code, message = end(args.run_dir, args.rc, bool(args.stopped), args.start_step, args.max_restarts)
    except (JobError, ValueError, FileNotFoundError) as e:
        print(f"slurm.job: error: {e}", file=sys.stderr)
        return EXIT_BAD
    print(message, file=sys.stderr if code == EXIT_GAVE_UP else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
