"""`pretrain import SOURCE OUT_RUN`: weights from elsewhere as a run directory `pretrain train` starts from.

SOURCE is a local Hugging Face folder (config.json with a model_type that a registered architecture's
`hf` adapter reads: Llama, into the baseline), an exported folder (pretrain export), or a run or
checkpoint directory. With `--arch`, the weights are converted into another architecture by its
registry `convert` (a Llama or a baseline run into a CRT with the llama block: function-preserving,
spec-000 §2.6). OUT_RUN receives config.yaml, tokenizer/ and checkpoints/step_00000000 (weights only,
marked imported); fine-tuning is a new run that starts from it:

    pretrain train OUT_RUN train.run_dir=runs/NAME checkpoint.init_from=OUT_RUN data.train=[PREFIX]

Everything is checked before anything is written, and OUT_RUN appears whole or not at all.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, fields
from typing import Any, Callable

HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
_NOT_CARRIED = {"arch", "paper_params", "paper_params_rounded"}  # model fields a conversion never copies


@dataclass
class Imported:
    arch: str
    model: Any  # the source's model config
    load_state: Callable[[], dict]  # -> full single-device tensors (read last, after every check)
    tokenizer: str | None  # a tokenizer path, or None
    what: str  # "a Hugging Face llama folder", ... (for the summary line)


def _hf_adapter(hf: dict, path: str):
    from pretrain.models import all_archs

    adapters = {s.hf.model_type: s for s in all_archs() if s.hf.model_type}
    spec = adapters.get(hf.get("model_type"))
    if spec is None:
        window = " (its sliding-window attention included)" if hf.get("sliding_window") else ""
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r}{window} is not supported; Hugging Face "
                         f"folders of model_type {', '.join(sorted(adapters))} are imported")
    return spec


def _hf_tensors(path: str):
    """(names, get(name)) over the folder's safetensors weights, one file or an index of shards."""
    from safetensors import safe_open

    from pretrain.export.tensorfile import read_header

    if os.path.isfile(index := os.path.join(path, HF_INDEX)):
        try:
            with open(index) as f:
                where = json.load(f)["weight_map"]
            files = {str(name): os.path.join(path, str(file)) for name, file in where.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is unreadable (no weight_map)") from None
    elif os.path.isfile(single := os.path.join(path, HF_WEIGHTS)):
        files = {name: single for name in read_header(single) if name != "__metadata__"}
    else:
        pickled = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.exists(os.path.join(path, n))]
        hint = f" ({pickled[0]} is a pickle, which is not read: save it with safe_serialization=True)" if pickled else ""
        raise ValueError(f"{path} holds no {HF_WEIGHTS} or {HF_INDEX}{hint}")
    held = {}
    for file in set(files.values()):
        if not os.path.isfile(file):
            raise ValueError(f"{path}: weights file {os.path.basename(file)} is missing")
        held[file] = set(read_header(file))  # a truncated or foreign file is named here
    for name, file in files.items():
        if name not in held[file]:
            raise ValueError(f"{path}: the index puts {name} in {os.path.basename(file)}, which does not hold it")
    handles: dict = {}

    def get(name: str):
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt", device="cpu")
        return handles[file].get_tensor(name)

    return set(files), get


def _read_hf(path: str, tokenizer: str) -> Imported:
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        if not isinstance(hf, dict):
            raise ValueError
    except (OSError, ValueError):
        raise ValueError(f"{path}/config.json is not a JSON object") from None
    spec = _hf_adapter(hf, path)
    try:
        model = spec.config_cls(**spec.hf.model_fields(hf))
        model.validate()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

    def load_state() -> dict:
        names, get = _hf_tensors(path)
        try:
            return spec.hf.weights_from_hf(model, names, get)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    if not tokenizer:
        found = [n for n in ("tokenizer.json", "tokenizer.model") if os.path.isfile(os.path.join(path, n))]
        tokenizer = os.path.join(path, found[0]) if found else None
    return Imported(spec.name, model, load_state, tokenizer, f"a Hugging Face {hf['model_type']} folder")


def _read_exported(path: str, config: dict, tokenizer: str) -> Imported:
    from pretrain.export.loader import folder_state
    from pretrain.models import get_arch

    spec = get_arch(config["arch"])
    try:  # the model config alone: the folder's training config is not this run's
        model = spec.config_cls(**config["model"])
        model.validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}/config.json has an unusable model config ({e})") from None
    tok = tokenizer or (os.path.join(path, config["tokenizer"]) if config.get("tokenizer") else None)
    return Imported(spec.name, model, lambda: folder_state(path, config), tok, "an exported folder")


def _read_run(path: str, tokenizer: str, log) -> Imported:
    from pretrain.checkpoint import checkpoint_to_read
    from pretrain.export.source import read_checkpoint
    from pretrain.runs import stored_config

    ckpt, _ = checkpoint_to_read(path)
    _, cfg, run_dir = stored_config(ckpt, log=lambda _: None)
    return Imported(cfg.model.arch, cfg.model, lambda: read_checkpoint(path, log).state,
                    tokenizer or cfg.data.tokenizer or None, f"the run {run_dir}")


def read_source(path: str, tokenizer: str = "", log=print) -> Imported:
    from pretrain.export.loader import folder_config

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    if (config := folder_config(path)) is not None:
        return _read_exported(path, config, tokenizer)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _read_hf(path, tokenizer)
    return _read_run(path, tokenizer, log)


def target_model_fields(source, arch: str) -> dict:
    """The target config's model fields: those both configs have (from the source), then what the
    target's convert_fields fixes for this source."""
    from pretrain.models import get_arch

    spec = get_arch(arch)
    shared = {f.name for f in fields(spec.config_cls)} - _NOT_CARRIED
    values = {name: getattr(source.model, name) for name in shared if hasattr(source.model, name)}
    if arch != source.arch:
        values.update(spec.convert_fields(source.arch, source.model))
    return {"arch": arch, **values}


def import_run(source: str, out: str, arch: str = "", overrides=(), force: bool = False, tokenizer: str = "",
               log=print) -> dict:
    """Import `source` into run directory `out` (see the module docstring); returns a summary. Every
    check (architectures, overrides, vocabulary, shapes) comes before the weights are read."""
    import torch

    from data_tools.tokenizer import load_tokenizer
    from pretrain.checkpoint import SavedModel, save_checkpoint
    from pretrain.config import RUN_CONFIG, DataConfig, config_from_dict, to_yaml
    from pretrain.export.source import atomic_folder, check_output
    from pretrain.init_from import Source, state_for
    from pretrain.models import count_parameters, get_arch, meta_model, weight_shapes

    check_output(out, force, source)
    if tokenizer and not os.path.exists(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer} does not exist")
    src = read_source(source, tokenizer, log)
    arch = arch or src.arch
    spec = get_arch(arch)
    if arch != src.arch and not spec.converts:
        raise ValueError(f"--arch {arch}: model.arch {arch!r} has no conversion from {src.arch!r} (no `convert` in "
                         "its registry entry)")
    out_abs = os.path.abspath(out)
    tok = load_tokenizer(src.tokenizer) if src.tokenizer else None  # tok.path: the file, if a folder was named
    base = {"model": target_model_fields(src, arch),
            "data": {"tokenizer": os.path.join(out_abs, "tokenizer", os.path.basename(tok.path)) if tok else "",
                     "seq_len": min(DataConfig.seq_len, src.model.max_seq_len)},
            "train": {"name": os.path.basename(out_abs), "run_dir": out_abs}}
    cfg = config_from_dict(base, overrides=list(overrides))
    if tok is not None and tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer {tok.path} has {tok.vocab_size} tokens but the model's vocabulary is "
                         f"{cfg.model.vocab_size}: they do not match (pass --tokenizer PATH)")
    shapes = weight_shapes(cfg.model)
    how = Source(source, "", False, src.arch, src.model, spec.convert if arch != src.arch else None)
    with torch.device("meta"):  # the conversion and the shapes, decided before any weight is read
        state_for(how, cfg, meta_model(src.model).state_dict(), shapes, name=source)
    counts = count_parameters(meta_model(cfg.model))
    saved = SavedModel()
    saved.state = state_for(how, cfg, src.load_state(), shapes, name=source)
    meta = {"consumed_samples": 0, "config": cfg.to_dict(), "imported_from": os.path.abspath(source),
            "tokenizer": os.path.basename(tok.path) if tok else None}
    with atomic_folder(out, force, source) as tmp:
        with open(os.path.join(tmp, RUN_CONFIG), "w") as f:
            f.write(to_yaml(cfg))
        if tok is not None:
            os.makedirs(os.path.join(tmp, "tokenizer"))
            shutil.copy2(tok.path, os.path.join(tmp, "tokenizer", os.path.basename(tok.path)))
        save_checkpoint(tmp, 0, saved, None, meta)
    converted = f", converted from {src.arch!r} by the registry's convert" if arch != src.arch else ""
    return {"out": out, "arch": arch, "source": src.what, "params": counts["total"], "converted": converted,
            "tokenizer": bool(tok)}


def finetune_command(out: str) -> str:
    return (f"pretrain train {out} train.run_dir=runs/NAME checkpoint.init_from={out} data.train=[PREFIX] "
            "train.max_steps=N")
