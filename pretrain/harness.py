"""`pretrain eval PATH --lm-eval TASKS`: lm-evaluation-harness on a run, a checkpoint or an exported folder.

The harness loads Hugging Face folders (`--model hf`), so the source becomes one first:

    a Hugging Face folder (`pretrain export --format hf`)   used as it is
    a run or a checkpoint directory                         exported with --format hf to a temporary folder
    a native exported folder (`pretrain export`)            imported as a temporary run, then exported so

The baseline's folder is transformers' Llama; every other architecture's carries its own code
(pretrain/hf_remote), loaded with trust_remote_code. The harness runs at batch size 1: the recurrent
models' state has no notion of a padded position (their folders refuse a padded batch).

The table is printed and the results (the harness's per-task metrics, its config and versions) are
stored as JSON beside the source:

    a run directory                  RUN/lm_eval/step_<N>-<tasks>.json   (N: the checkpoint evaluated)
    a checkpoint directory of a run  the same file in its run directory
    a folder (native or HF)          FOLDER.lm_eval-<tasks>.json, beside the folder (the folder is not changed)

lm-eval is an optional dependency (`pip install 'recurrent-pretrain[lm-eval]'`); without it the command
says so in one sentence.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile

from data_tools.files import atomic_write

INSTALL = "pip install 'lm-eval[hf]>=0.4.5' (this package's [lm-eval] extra)"


def check_installed() -> None:
    if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None:
        raise ValueError(f"--lm-eval needs lm-evaluation-harness with its Hugging Face backend: {INSTALL}")


def task_manager(tasks: list[str], include_path: str = ""):
    """The harness's TaskManager with `include_path`; ValueError naming a task it does not know."""
    from lm_eval.tasks import TaskManager

    if include_path and not os.path.isdir(include_path):
        raise ValueError(f"--lm-eval-include {include_path} is not a directory of task YAML files")
    manager = TaskManager(include_path=include_path or None)
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            hint = f" (nor among the YAML files under {include_path})" if include_path else \
                " (a task of your own: --lm-eval-include DIR with its YAML file)"
            raise ValueError(f"lm-eval task {task!r} does not exist{hint}")
    return manager


def source_kind(path: str) -> str:
    """hf | native | run | checkpoint, for a path `pretrain eval` was given."""
    from pretrain.checkpoint import checkpoint_to_read
    from pretrain.export.loader import is_export_folder

    if is_export_folder(path):
        return "native"
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            raise ValueError(f"{config} is not readable JSON (a Hugging Face folder's config)") from None
        if isinstance(hf, dict) and isinstance(hf.get("model_type"), str):
            return "hf"
    _, is_run = checkpoint_to_read(path)  # FileNotFoundError / ValueError naming what the path is not
    return "run" if is_run else "checkpoint"


def results_path(path: str, kind: str, tasks: list[str], step: int | None) -> str:
    """Where the results are stored (the module docstring's table)."""
    tag = re.sub(r"[^A-Za-z0-9_.+-]+", "_", "+".join(tasks))[:120]
    folder = os.path.normpath(path)
    if kind in ("hf", "native"):
        return f"{folder}.lm_eval-{tag}.json"
    run = folder if kind == "run" else os.path.dirname(os.path.dirname(folder))
    return os.path.join(run, "lm_eval", f"step_{step:08d}-{tag}.json")


def _hf_folder(path: str, kind: str, tmp: str, log) -> tuple[str, int | None]:
    """(a Hugging Face folder of the source, the step it holds or None)."""
    from pretrain.export.importer import import_run
    from pretrain.export.writer import export

    if kind == "hf":
        return path, None
    source = path
    if kind == "native":
        source = os.path.join(tmp, "run")
        import_run(path, source, log=lambda *_: None)
    out = os.path.join(tmp, "hf")
    log(f"exporting {path} as a Hugging Face folder (temporary) for the harness")
    summary = export(source, out, fmt="hf", log=lambda *_: None)
    return out, int(summary["step"]) if kind != "native" else None


def run_harness(path: str, tasks: list[str], include_path: str = "", limit: float | None = None,
                device: str = "cpu", log=print) -> dict:
    """Run the harness's `tasks` on `path`; returns {"table", "results", "stored"}."""
    check_installed()
    if not tasks or any(not t for t in tasks):
        raise ValueError("--lm-eval takes a comma-separated list of task names, e.g. --lm-eval hellaswag,lambada_openai")
    manager = task_manager(tasks, include_path)
    kind = source_kind(path)
    tmp = None if kind == "hf" else tempfile.mkdtemp(prefix=".lm_eval-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        folder, step = _hf_folder(path, kind, tmp, log)
        import lm_eval
        from lm_eval.utils import make_table

        out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": folder, "trust_remote_code": True},
                                      tasks=tasks, batch_size=1, device=device, limit=limit, log_samples=False,
                                      task_manager=manager)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    table = make_table(out)
    stored = results_path(path, kind, tasks, step)
    record = {"source": os.path.abspath(path), "kind": kind, "step": step, "tasks": tasks,
              "results": out.get("results"), "versions": out.get("versions"), "n-shot": out.get("n-shot"),
              "config": {k: v for k, v in (out.get("config") or {}).items() if k != "model_args"},
              "lm_eval_version": getattr(lm_eval, "__version__", None)}
    os.makedirs(os.path.dirname(stored) or ".", exist_ok=True)
    atomic_write(stored, json.dumps(record, indent=2, default=str))
    return {"table": table, "results": out.get("results"), "stored": stored}
