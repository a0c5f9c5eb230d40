"""Loading a run configuration: YAML files, run directories, stored configs, dotted overrides.

    cfg = load_config("baseline/tiny", ["optim.lr=1e-3", "train.max_steps=200"])

The YAML's `model.arch` selects the architecture's config class from the registry; OmegaConf merges
the file and the overrides onto the typed schema (pretrain/run_config.py), so an unknown key or a
wrong type is an error naming the key. Validation refuses impossible or unsupported settings with
one sentence naming the field, before any model, dataset or process group exists; with check_data it
also checks what training reads, checkpoint.init_from's weights included (pretrain/init_from.py).
"""
from __future__ import annotations

import os
import re
from dataclasses import fields
from importlib import resources

from pretrain import init_from
from pretrain.run_config import (  # noqa: F401  (the typed config, imported from here by callers)
    CheckpointConfig, ConfigError, DataConfig, LogConfig, ParallelConfig, RunConfig, TrainConfig, from_dict,
    one_line, to_yaml, typed_config)
from pretrain.runs import relocate

RUN_CONFIG = "config.yaml"  # a run directory's resolved config


def config_path(source: str) -> str:
    """A YAML path, a run directory (its config.yaml), or a short name like "baseline/tiny" of a
    config shipped with the package."""
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, RUN_CONFIG)):
        return os.path.join(source, RUN_CONFIG)
    if os.path.isfile(source):
        return source
    shipped = shipped_file(source)
    if shipped:
        return shipped
    if os.path.isdir(source):
        raise ConfigError(f"{source} is a directory without a {RUN_CONFIG}: not a run directory")
    raise ConfigError(f"config {source!r} is neither a file, a run directory nor a shipped config; "
                      f"{_closest(source)} (`pretrain info --list` lists the shipped configs)")


def shipped_file(name: str) -> str:
    """The path of a YAML file shipped in the configs package by its short name ("baseline/tiny",
    "rt/papers/table1-300m"; .yaml optional), or "" when there is none."""
    name = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    shipped = resources.files("configs").joinpath(name)
    return str(shipped) if shipped.is_file() else ""


def _closest(source: str) -> str:
    """"did you mean X or Y?" for a misspelled shipped config name (or the groups there are)."""
    import difflib

    names = shipped_configs()
    name = source[:-5] if source.endswith((".yaml", ".yml")) else source
    name = name.split("configs/", 1)[-1]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if not close:  # the group at least: "crt/tny" -> the crt configs
        group = name.split("/", 1)[0]
        close = [n for n in names if n.split("/", 1)[0] == group][:3]
    if close:
        return "did you mean " + " or ".join(close) + "?"
    return "shipped groups: " + ", ".join(sorted({n.split("/", 1)[0] for n in names}))


def shipped_configs() -> list[str]:
    root = resources.files("configs")
    out = []
    for group in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        out += [f"{group}/{f.name[:-5]}" for f in sorted(root.joinpath(group).iterdir(), key=lambda f: f.name)
                if f.name.endswith(".yaml")]
    return out


def load_config(source: str, overrides: list[str] | tuple = (), check_data: bool = True, log=print) -> RunConfig:
    """Load, merge overrides (`section.key=value`), type-check and validate a run config. `source`
    may be a run directory: its stored config, with the paths found where the run now is
    (pretrain/runs.py) and train.run_dir set to it unless overridden."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = config_path(source)
    raw = _read_yaml(path)
    try:
        cli = OmegaConf.from_dotlist(list(overrides))
    except Exception as e:
        raise ConfigError(f"cannot read the overrides: {one_line(e)}") from None
    try:
        cfg = typed_config(raw, cli)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config {path}: {one_line(e)}") from None
    if os.path.basename(path) == RUN_CONFIG and os.path.isdir(source):
        run_dir = cfg.train.run_dir
        relocate(cfg, source, log)
        if OmegaConf.select(cli, "train.run_dir") is not None:
            cfg.train.run_dir = run_dir
    return _check_reads(cfg.validate(check_data=check_data), check_data)


def _read_yaml(path: str):
    """A config file's YAML as an OmegaConf mapping; anything else is one sentence naming the file
    (never its contents: the file may be anything, /etc/passwd or a binary)."""
    from omegaconf import OmegaConf

    expected = "a YAML mapping of sections (model, data, train, ...)"
    try:
        with open(path, "rb") as f:
            data = f.read(8 << 20)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    if not data.strip():
        raise ConfigError(f"config {path} is empty; expected {expected}")
    if b"\0" in data:
        raise ConfigError(f"config {path} is a binary file; expected {expected}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not UTF-8 text; expected {expected}") from None
    try:
        raw = OmegaConf.create(text)  # OmegaConf's YAML loader (it reads 1e-3 as a float)
    except Exception as e:  # yaml's messages quote the offending line: keep only where it is
        mark = getattr(e, "problem_mark", None) or getattr(getattr(e, "__cause__", None), "problem_mark", None)
        if mark is None:
            raise ConfigError(f"config {path} is not {expected}") from None
        raise ConfigError(f"config {path} is not valid YAML (line {mark.line + 1}, column {mark.column + 1}); "
                          f"expected {expected}") from None
    if not OmegaConf.is_dict(raw):
        raise ConfigError(f"config {path} is not {expected}")
    sections = [f.name for f in fields(RunConfig)]
    for key, value in raw.items_ex(resolve=False):
        if str(key) not in sections:  # a key is named only when it looks like one (not a line of a file)
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,39}", str(key)):
                raise ConfigError(f"config {path} is not {expected}")
            raise ConfigError(f"config {path}: unknown section {key!r} (sections: {', '.join(sections)})")
        if not (value is None or OmegaConf.is_dict(value)):
            raise ConfigError(f"config {path}: section {key} is not a mapping of fields")
    return raw


def config_from_dict(d: dict, check_data: bool = False, overrides: list[str] | tuple = ()) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (as stored in checkpoints), with dotted overrides."""
    return _check_reads(from_dict(d, check_data, overrides), check_data)


def _check_reads(cfg: RunConfig, check_data: bool) -> RunConfig:
    """With check_data, after validate(): the weights a new run starts from are read like its data,
    so they are checked here, before any work (pretrain/init_from.py)."""
    if check_data:
        init_from.check(cfg)
    return cfg


def config_summary(cfg: RunConfig, run_dir: str) -> list[str]:
    """A few lines of what a run is (data, optimizer and schedule, checkpoints): the start of `pretrain
    train`'s output; the whole resolved config is the run directory's config.yaml (log.show_config
    prints it instead)."""
    d, o, s, t, c = cfg.data, cfg.optim, cfg.schedule, cfg.train, cfg.checkpoint
    names = lambda paths: ", ".join(os.path.basename(p) for p in paths) or "-"  # noqa: E731
    if d.task:
        data = f"data: task {d.task} ({d.task_params})"
    else:
        valid = names(d.valid) if d.valid else f"a {d.resolved_split()} split of the training data"
        data = (f"data: train {names(d.train)} | valid {valid} | tokenizer "
                f"{os.path.basename(d.tokenizer) if d.tokenizer else '-'}")
    return [f"config: {os.path.join(run_dir, RUN_CONFIG)} (every resolved field; log.show_config=true prints it here)",
            f"{data} | T={d.seq_len}",
            f"optim: AdamW lr {o.lr:g} -> {o.min_lr:g}, betas ({o.beta1:g}, {o.beta2:g}), weight decay {o.weight_decay:g}"
            f"{' (every parameter)' if o.decay_all else ''}, clip {o.grad_clip:g} | schedule {s.kind}, warmup "
            f"{s.warmup_steps} | {t.max_steps:,} steps",
            (f"evaluation every {t.eval_every} steps" if t.eval_every else "evaluation at the end")
            + f" ({t.eval_batches} batches) | checkpoints " + (f"every {c.every} steps" if c.every else "at the end")
            + f" (keep {c.keep_last}) | progress every {t.log_every} steps"]
