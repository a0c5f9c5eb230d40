"""Loading an exported folder (pretrain/export/writer.py) with torch and safetensors only.

No megatron-core, DeepSpeed, process group or torch.distributed.checkpoint is imported: the model is
built single-device through the registry (parallel.layers' plain torch modules) and its tensors are
read memory-mapped, one at a time, into it. Besides torch and safetensors, only this package's own
light dependencies are used (omegaconf for the config, xxhash for the checksum). The weights file is checked against the checksum
config.json records, so a damaged folder is refused naming the file rather than sampled from.
"""
from __future__ import annotations

import json
import os

from pretrain.export.writer import CONFIG_FILE, FORMAT, FORMAT_VERSION, GENERATION_FILE, SAMPLING, WEIGHTS_FILE  # noqa: F401


def folder_config(path: str) -> dict | None:
    """config.json of an exported folder, or None when `path` is not one (a run, a checkpoint, an HF
    folder); ValueError for a folder that claims the format but is unreadable or newer."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is unreadable ({type(e).__name__})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        return None
    if not isinstance(config.get("format_version"), int) or config["format_version"] > FORMAT_VERSION:
        raise ValueError(f"{file} has format_version {config.get('format_version')!r}; this code reads up to "
                         f"{FORMAT_VERSION} (update it)")
    for key, kind in (("arch", str), ("model", dict), ("aliases", dict)):
        if not isinstance(config.get(key), kind):
            raise ValueError(f"{file} has no valid {key!r} entry")
    return config


def is_export_folder(path: str) -> bool:
    return os.path.isdir(path) and folder_config(path) is not None


def _run_config(path: str, config: dict, overrides) -> "RunConfig":  # noqa: F821
    """The RunConfig to use the folder with: the training config (single-device, paths as stored)
    with the folder's model and tokenizer, then the overrides eval/generate allow."""
    from pretrain.config import config_from_dict
    from pretrain.runs import check_inference_overrides

    stored = dict((config.get("training") or {}).get("config") or {})
    stored = {k: v for k, v in stored.items() if k not in ("parallel", "checkpoint")}  # a training layout's
    stored["model"] = config["model"]
    data = dict(stored.get("data") or {})
    data["tokenizer"] = os.path.join(os.path.abspath(path), config["tokenizer"]) if config.get("tokenizer") else ""
    stored["data"] = data
    stored["train"] = {**(stored.get("train") or {}), "run_dir": os.path.abspath(path)}
    check_inference_overrides(stored, list(overrides))
    return config_from_dict(stored, overrides=list(overrides))


def checked_weights(path: str, config: dict, verify: bool = True) -> tuple[str, set]:
    """(the folder's weights file, the tensor names it holds) after checking that it is whole (its
    header against its size) and, with `verify`, that it matches the checksum recorded at export."""
    from data_tools.files import file_checksum
    from pretrain.export.tensorfile import read_header

    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise ValueError(f"{path} is incomplete (no {WEIGHTS_FILE})")
    names = set(read_header(weights)) - {"__metadata__"}  # a truncation is named before the file is mapped
    expected = (config.get("checksums") or {}).get(WEIGHTS_FILE)
    if verify and expected and file_checksum(weights) != expected:
        raise ValueError(f"{weights} is corrupt (it does not match the checksum recorded at export)")
    return weights, names


def folder_state(path: str, config: dict, verify: bool = True) -> dict:
    """The folder's tensors by state-dict name, tied names included (pretrain import reads it)."""
    from safetensors.torch import load_file

    weights, _ = checked_weights(path, config, verify)
    state = load_file(weights)
    for name, first in config["aliases"].items():
        if first not in state:
            raise ValueError(f"{weights} has no tensor {first} (config.json's aliases name it)")
        state[name] = state[first]
    return state


def load_folder(path: str, device: str = "cpu", overrides=(), log=print, need: tuple = ("tokenizer",),
                verify: bool = True):
    """(model in eval mode, its ArchSpec, RunConfig, tokenizer or None) from exported folder `path`.
    `checkpoint.verify=false` among the overrides (or verify=False) skips the checksum."""
    import torch
    from safetensors import safe_open

    from pretrain.models import get_arch

    config = folder_config(path)
    if config is None:
        raise ValueError(f"{path} is not an exported folder (no {CONFIG_FILE} of format {FORMAT!r})")
    cfg = _run_config(path, config, overrides)
    cfg.data.check_files(need)
    weights, present = checked_weights(path, config, verify and cfg.checkpoint.verify)
    spec = get_arch(cfg.model.arch)
    with torch.device(device):  # initialised, then overwritten tensor by tensor
        model = spec.build(cfg.model)
    if cfg.train.precision == "fp64":  # a numerical-check run's weights keep every digit, as from its checkpoints
        model = model.double()
    aliases = config["aliases"]
    state = model.state_dict()
    for name in state:
        source = name if name in present else aliases.get(name)
        if source not in present:
            raise ValueError(f"{weights} has no tensor {name} (exported from a different model?)")
    extra = sorted(present - set(state))
    if extra:
        raise ValueError(f"{weights} has {extra[0]}, which model.arch {cfg.model.arch!r} lacks (and {len(extra) - 1} "
                         "more)")
    with safe_open(weights, framework="pt", device="cpu") as f, torch.no_grad():
        for name, tensor in state.items():
            value = f.get_tensor(name if name in present else aliases[name])
            if value.shape != tensor.shape:
                raise ValueError(f"{weights} has {name} of shape {tuple(value.shape)}, the model has "
                                 f"{tuple(tensor.shape)}")
            tensor.copy_(value)
    model.eval()
    tokenizer = None
    if cfg.data.tokenizer:
        from data_tools.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer)
    return model, spec, cfg, tokenizer


def sampling_defaults(path: str) -> dict:
    """The folder's generation_config.json sampling values (temperature, top_k, top_p), if any."""
    file = os.path.join(path, GENERATION_FILE)
    try:
        with open(file) as f:
            gen = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: gen[k] for k in ("temperature", "top_k", "top_p") if isinstance(gen.get(k), (int, float))}
