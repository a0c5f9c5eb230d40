"""Render the sbatch scripts from a cluster profile: the #SBATCH header and the profile block.

The scripts in slurm/ run as they are (`sbatch slurm/train.sbatch CONFIG`); rendering replaces their
#SBATCH lines with the profile's and their `# >>> profile` block with its variables, setup lines and
environment, and bakes in the arguments, so that the rendered file alone reproduces the job.
"""
from __future__ import annotations

import os
import re
import shlex

from slurm.profile import ClusterProfile

HERE = os.path.dirname(os.path.abspath(__file__))
_BLOCK = re.compile(r"# >>> profile[^\n]*\n.*?# <<< profile\n", re.S)


def sbatch_lines(profile: ClusterProfile, job_name: str, output: str, *, array: str = "", tasks_per_node: int = 1,
                 nodes: int | None = None, grace_s: float = 60.0, requeue: bool = True) -> list[str]:
    lines = [f"--job-name={job_name}", f"--partition={profile.partition}", f"--nodes={nodes or profile.nodes}",
             f"--ntasks-per-node={tasks_per_node}", f"--cpus-per-task={profile.cpus_per_task}",
             f"--time={profile.time}", f"--output={output}", "--open-mode=append"]
    if profile.gpus_per_node:
        lines.append(f"--gpus-per-node={profile.gpus_per_node}")
    if profile.account:
        lines.append(f"--account={profile.account}")
    if profile.qos:
        lines.append(f"--qos={profile.qos}")
    if requeue:  # the warning must leave room for the checkpoint (grace) and the step under way
        lines += ["--requeue", f"--signal=B:USR1@{max(profile.signal_lead_s, int(grace_s) + 30)}"]
    if array:
        lines.append(f"--array={array}")
    return ["#SBATCH " + x for x in lines + list(profile.sbatch)]


def profile_block(profile: ClusterProfile, variables: dict, args: list[str]) -> str:
    out = ["# >>> profile: rendered by python -m slurm.submit"]
    out += [f"{k}={shlex.quote(str(v))}" for k, v in variables.items()]
    out += list(profile.setup)
    out += [f"export {k}={shlex.quote(str(v))}" for k, v in profile.env.items()]
    if args:
        out.append("[ $# -gt 0 ] || set -- " + " ".join(shlex.quote(a) for a in args))
    out.append("# <<< profile")
    return "\n".join(out) + "\n"


def render(template: str, header: list[str], block: str) -> str:
    """The template with its #SBATCH lines replaced by `header` and its profile block by `block`."""
    with open(os.path.join(HERE, template)) as f:
        text = f.read()
    lines = text.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    kept = [line for line in lines if not line.startswith("#SBATCH")]
    kept[first:first] = [h + "\n" for h in header]
    text, n = _BLOCK.subn(lambda _: block, "".join(kept))
    if n != 1:
        raise ValueError(f"slurm/{template} has no '# >>> profile' ... '# <<< profile' block")
    return text


def render_train(profile: ClusterProfile, config: str, overrides: list[str], run_dir: str, job_name: str,
                 grace_s: float = 60.0, array: str = "", points: str = "") -> str:
    per_node = profile.nproc if profile.launcher != "torchrun" else 1
    output = os.path.join(run_dir, "slurm", "%x-%j.out") if not array else os.path.join(run_dir, "slurm", "%x-%A_%a.out")
    header = sbatch_lines(profile, job_name, output, array=array, tasks_per_node=per_node, grace_s=grace_s)
    variables = {"LAUNCHER": profile.launcher, "NPROC": profile.nproc, "PYTHON": profile.python,
                 "MAX_RESTARTS": profile.max_restarts, "MPI_PLUGIN": profile.mpi_plugin, "SWEEP_POINTS": points}
    return render("train.sbatch", header, profile_block(profile, variables, [config, *overrides]))


def render_preprocess(profile: ClusterProfile, out_prefix: str, inputs_file: str, tasks: int, args: list[str],
                      json_keys: list[str], merge: bool) -> str:
    array = "" if merge else f"0-{tasks - 1}"
    name = "preprocess-merge" if merge else "preprocess"
    logs = os.path.join(out_prefix + ".parts", "logs", "%x-%j.out" if merge else "%x-%A_%a.out")
    header = sbatch_lines(profile, name, logs, array=array, nodes=1, requeue=False)
    variables = {"PYTHON": profile.python, "STAGE": "merge" if merge else "tokenize", "TASKS": tasks,
                 "OUT_PREFIX": out_prefix, "INPUTS_FILE": inputs_file, "JSON_KEYS": " ".join(json_keys)}
    return render("preprocess.sbatch", header, profile_block(profile, variables, ["--", *args] if args else []))


def render_command(profile: ClusterProfile, job_name: str, output: str, command: str) -> str:
    """A one-node, one-task job that runs `command` after the profile's setup lines and environment (an
    evaluation step after a sweep's array, say); not requeued."""
    header = sbatch_lines(profile, job_name, output, nodes=1, requeue=False)
    lines = ["#!/bin/bash", *header, "set -euo pipefail", *profile.setup,
             *(f"export {k}={shlex.quote(str(v))}" for k, v in profile.env.items()), command]
    return "\n".join(lines) + "\n"
