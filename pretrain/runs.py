"""A run directory that can move: where its stored paths are found, and what may change after training.

The rule (README, "Runs can move"):
1. When training starts, every path of the config (data.train, data.valid, data.tokenizer,
   data.cache_dir, train.run_dir, checkpoint.init_from) is made absolute, so the stored config.yaml
   and each checkpoint's config work from any working directory.
2. Reading a run back (`pretrain train RUN_DIR`, `eval`, `generate`, `export`), a stored path
   that no longer exists is looked up at the same place relative to the run directory: a run moved
   together with its data (e.g. a whole project folder copied elsewhere) still works. Runs from
   before rule 1 stored relative paths; those are taken relative to the directory the run was
   started in, inferred from where its relative train.run_dir now lies.
3. A tokenizer found nowhere falls back to the copy every run keeps in RUN_DIR/tokenizer/.
4. What is still missing is reported by validation in one sentence naming the path and the field
   to override (`pretrain eval RUN data.valid=[PREFIX]`).
"""
from __future__ import annotations

import os

DATASET_FIELDS = ("train", "valid")


def _exists(field: str, path: str) -> bool:
    if field in DATASET_FIELDS:  # a .bin/.idx prefix
        return os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin")
    return os.path.exists(path)


def make_absolute(cfg) -> None:
    """Rule 1, in place: a starting run's paths, absolute against the current working directory."""
    d = cfg.data
    d.train, d.valid = [os.path.abspath(p) for p in d.train], [os.path.abspath(p) for p in d.valid]
    if d.tokenizer:
        d.tokenizer = os.path.abspath(d.tokenizer)
    if d.cache_dir:
        d.cache_dir = os.path.abspath(d.cache_dir)
    cfg.train.run_dir = os.path.abspath(cfg.train.run_dir)
    if cfg.checkpoint.init_from:
        cfg.checkpoint.init_from = os.path.abspath(cfg.checkpoint.init_from)


def _started_in(stored_run_dir: str, run_dir: str) -> str | None:
    """The working directory a run with a relative train.run_dir was started in, when the run still
    sits at that relative place below some directory (which is then that directory)."""
    rel, actual = os.path.normpath(stored_run_dir), os.path.abspath(run_dir)
    if actual == rel or not actual.endswith(os.sep + rel):
        return None
    return actual[: -len(rel) - 1] or os.sep


def relocate(cfg, run_dir: str, log=print) -> None:
    """Rules 2 and 3, in place, for a config stored in `run_dir` (where the run now is); sets
    train.run_dir to `run_dir`. Paths that exist are left alone; each path moved is said in a line."""
    stored = cfg.train.run_dir
    here = os.path.abspath(run_dir)
    started_in = None if os.path.isabs(stored) else _started_in(stored, here)

    def find(field: str, path: str, section: str = "data") -> str:
        if not path or (os.path.isabs(path) and _exists(field, path)):
            return path
        if not os.path.isabs(path):
            candidates = [os.path.join(started_in, path)] if started_in else []
        else:  # the same place relative to the run directory as when the run was saved
            candidates = [os.path.join(here, os.path.relpath(path, stored))]
        for c in map(os.path.normpath, candidates):
            if _exists(field, c):
                if c != os.path.abspath(path):
                    log(f"{section}.{field}: {path} is now found at {c}")
                return c
        return path

    d = cfg.data
    d.train = [find("train", p) for p in d.train]
    d.valid = [find("valid", p) for p in d.valid]
    d.cache_dir = find("cache_dir", d.cache_dir)
    d.tokenizer = find("tokenizer", d.tokenizer)
    copy = os.path.join(here, "tokenizer", os.path.basename(d.tokenizer))
    if d.tokenizer and not os.path.isfile(d.tokenizer) and os.path.isfile(copy):
        d.tokenizer = copy  # rule 3: silent, it is the run's own copy of the very file
    # the weights the run started from (read again only while the run has no checkpoint of its own)
    cfg.checkpoint.init_from = find("init_from", cfg.checkpoint.init_from, "checkpoint")
    cfg.train.run_dir = here


def stored_config(ckpt: str, log=print):
    """(meta.json, the stored RunConfig with its paths found where the run now is, the run directory)."""
    from pretrain.checkpoint import META_FILE, CheckpointError, read_meta
    from pretrain.run_config import from_dict

    meta = read_meta(ckpt)
    stored = meta.get("config")
    if not isinstance(stored, dict) or not isinstance(stored.get("model"), dict):
        raise CheckpointError(f"checkpoint {ckpt} holds no run config in its {META_FILE}")
    cfg = from_dict(stored)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    relocate(cfg, run_dir, log)
    return meta, cfg, run_dir


# Fields `pretrain eval`/`generate` accept as overrides: those that leave the trained function alone
# or only say where things are. model.* fields are allowed when every weight keeps its shape (an
# architecture's inference-time fields, such as a loop count, pass; widths and depths do not).
INFERENCE_FIELDS = {"data": None, "checkpoint": {"verify"},
                    "train": {"eval_batches", "micro_batch_seqs", "threads", "device", "compile"}}
RUNTIME_FIELDS = ("train.threads", "train.device", "train.compile")  # honoured by eval/generate only when given


def check_inference_overrides(stored: dict, overrides: list[str]) -> None:
    """Refuse, in one sentence naming the field, an override `eval`/`generate` cannot honour."""
    from omegaconf import OmegaConf

    from pretrain.models import weight_shapes
    from pretrain.run_config import ConfigError, from_dict, one_line

    try:
        cli = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except Exception as e:
        raise ConfigError(f"cannot read the overrides: {one_line(e)}") from None
    allowed = ", ".join(["data.*", "model fields that keep the weights' shapes"]
                        + [f"{s}.{k}" for s, ks in INFERENCE_FIELDS.items() if ks for k in sorted(ks)])
    for section, values in cli.items():
        keys = values.keys() if isinstance(values, dict) else [None]
        for key in keys:
            name = f"{section}.{key}" if key is not None else section
            if section == "model" and key is not None and key != "arch":
                continue  # checked below, by building the model
            if section not in INFERENCE_FIELDS or key is None or (
                    INFERENCE_FIELDS[section] is not None and key not in INFERENCE_FIELDS[section]):
                raise ConfigError(f"{name} cannot be overridden after training (allowed: {allowed})")
    model_keys = [k for k in (cli.get("model") or {}) if k != "arch"]
    if not model_keys:
        return
    before = weight_shapes(from_dict(stored).model)
    for key in model_keys:
        one = OmegaConf.merge(OmegaConf.create(stored), {"model": {key: cli["model"][key]}})
        after = weight_shapes(from_dict(OmegaConf.to_container(one)).model)
        changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        if changed:
            n = changed[0]
            raise ConfigError(f"model.{key}={cli['model'][key]} would change the trained weights' shapes "
                              f"({n}: {before.get(n)} -> {after.get(n)}); it cannot be overridden after training")
