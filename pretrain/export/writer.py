"""`pretrain export RUN_OR_CHECKPOINT OUT`: a trained model as a self-contained folder.

The native folder (every architecture):
    config.json             {"format": "recurrent-pretrain", "arch", "model": the model config,
                             "dtype", "tokenizer", "aliases" (tied names), "checksums", "training": ...}
    model.safetensors       the single-device model's tensors under their state-dict names (a tied
                            tensor once, under its first name; config.json's aliases name the others)
    <tokenizer file>        the run's tokenizer (a sentencepiece .model or a tokenizer.json)
    generation_config.json  sampling defaults `pretrain generate` uses for this folder
    README.md               the model card: architecture, parameters, training tokens, validation loss

`--format hf` writes what transformers loads instead (an architecture whose registry entry has an
`hf` adapter: the baseline, as LlamaForCausalLM). Either way the checkpoint is read once, as full
tensors, and each tensor is converted only while it is written (pretrain/export/tensorfile.py), so
export holds one copy of the weights plus one tensor.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time

from data_tools.storage import check_space, storage_operation

FORMAT, FORMAT_VERSION = "recurrent-pretrain", 1
CONFIG_FILE, WEIGHTS_FILE, GENERATION_FILE, CARD_FILE = ("config.json", "model.safetensors",
                                                         "generation_config.json", "README.md")
DTYPES = ("float32", "bfloat16", "float16")
SAMPLING = {"temperature": 0.8, "top_k": 0, "top_p": 1.0}  # `pretrain generate`'s defaults


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _final_metrics(run_dir: str, step: int) -> dict:
    """The last logged training tokens and validation loss at or before `step` (metrics.jsonl)."""
    path, out = os.path.join(run_dir, "metrics.jsonl"), {}
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed run
            if not isinstance(r, dict) or not isinstance(r.get("step"), int) or r["step"] > step:
                continue
            if "tokens" in r:
                out["tokens"] = r["tokens"]
            if "val_loss" in r:
                out.update(val_loss=r["val_loss"], val_step=r["step"])
    return out


def _tokenizer(cfg, given: str):
    """(file, Tokenizer) of the tokenizer to ship (`given`, else the run's), or (None, None) for a run
    trained without one."""
    from data_tools.tokenizer import load_tokenizer

    path = given or cfg.data.tokenizer
    if not path:
        return None, None
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer {path} does not exist" if given else f"the run's tokenizer {path} was not "
                         "found (nor its copy in the run directory); pass --tokenizer PATH")
    tok = load_tokenizer(path)
    return tok.path, tok  # a directory given resolves to its one tokenizer file


def export(source: str, out: str, fmt: str = "native", dtype: str = "", force: bool = False,
           tokenizer: str = "", log=print, command: str = "", progress=None) -> dict:
    """Export checkpoint or run `source` to folder `out` (see the module docstring); returns a summary.
    progress(tensors written, tensors), when given, is called as the weights are written."""
    import torch

    from pretrain.export.source import atomic_folder, check_output, read_checkpoint, tied_aliases
    from pretrain.export.tensorfile import write_safetensors
    from pretrain.models import count_parameters, meta_model

    if fmt not in ("native", "hf"):
        raise ValueError(f"--format {fmt!r} is not one of native, hf")
    if dtype and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_output(out, force, source)
    t0 = time.perf_counter()
    arch, spec, tok_path, tok = _check_source(source, fmt, tokenizer)
    ck = read_checkpoint(source, log)
    cfg = ck.cfg
    meta_copy = meta_model(cfg.model)  # names, tied tensors and parameter counts
    aliases = tied_aliases(meta_copy)
    specs, tensor_of = _tensor_plan(ck, aliases, fmt, spec, dtype)
    counts = count_parameters(meta_copy)
    metrics = _final_metrics(ck.run_dir, int(ck.meta["step"]))
    metrics.setdefault("tokens", int(ck.meta["step"]) * cfg.tokens_per_step)
    kinds = sorted({str(d).removeprefix("torch.") for _, d in specs.values()})
    dtype_name = kinds[0] if len(kinds) == 1 else "mixed: " + ", ".join(kinds)
    needed = sum(math.prod(shape) * torch.empty((), dtype=d).element_size() for shape, d in specs.values())
    operation = f"exporting {source} to {out}"
    check_space(operation, out, needed)  # before anything is written
    with storage_operation(operation, out, needed), atomic_folder(out, force, source) as tmp:  # partial files removed
        if progress is not None:
            tensor_of = _counted(tensor_of, progress, len(specs))
        size = write_safetensors(os.path.join(tmp, WEIGHTS_FILE), specs, tensor_of, {"format": "pt"})
        tok_files = _copy_tokenizer(tmp, tok_path, tok, fmt, spec)
        if fmt == "hf":
            _write_json(os.path.join(tmp, CONFIG_FILE), spec.hf.hf_config(cfg.model, dtype_name, tok))
            suppress = spec.never_sampled(cfg.model, tok.eod_id if tok else None, tok.pad_id if tok else None)
            _write_json(os.path.join(tmp, GENERATION_FILE), spec.hf.generation_config(tok, SAMPLING, suppress))
            for name, text in getattr(spec.hf, "remote_files", dict)().items():  # trust_remote_code's files
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
        else:
            _write_native_configs(tmp, ck, arch, dtype_name, tok, tok_files, aliases, counts, metrics)
        with open(os.path.join(tmp, CARD_FILE), "w") as f:
            f.write(model_card(cfg, counts, ck, metrics, fmt, dtype_name, tok_files, spec.hf, command or
                               f"pretrain export {source} {out}" + (" --format hf" if fmt == "hf" else "")))
    return {"out": out, "format": fmt, "arch": arch, "step": int(ck.meta["step"]), "checkpoint": ck.checkpoint,
            "bytes": size, "params": counts["total"], "dtype": dtype_name, "seconds": time.perf_counter() - t0}


def _check_source(source: str, fmt: str, tokenizer: str):
    """Refuse from the stored config, before the (long) read of the weights, what can be refused there;
    returns (arch, its registry spec, tokenizer file, Tokenizer)."""
    from pretrain.checkpoint import checkpoint_to_read
    from pretrain.models import get_arch
    from pretrain.runs import stored_config

    _, peek, _ = stored_config(checkpoint_to_read(source)[0], log=lambda _: None)
    arch = peek.model.arch
    spec = get_arch(arch)
    if spec.export_refusal:
        raise ValueError(f"model.arch {arch!r} cannot be exported: {spec.export_refusal}")
    if fmt == "hf":
        spec.hf.check_export(peek.model)  # the default adapter (registry.NoHF) refuses in one sentence
    tok_path, tok = _tokenizer(peek, tokenizer)
    if tok is not None and tok.vocab_size > peek.model.vocab_size:
        raise ValueError(f"the tokenizer {tok_path} has {tok.vocab_size} tokens, more than model.vocab_size "
                         f"{peek.model.vocab_size}")
    return arch, spec, tok_path, tok


def _tensor_plan(ck, aliases: dict, fmt: str, spec, dtype: str):
    """({name: (shape, dtype)} of the tensors the folder holds, tensor_of(name) producing each in that dtype)."""
    import torch

    first = {name: t for name, t in ck.state.items() if name not in aliases}
    target = getattr(torch, dtype) if dtype else None  # None: every tensor keeps its own dtype

    def cast(t):
        return t.to(target) if target is not None and t.is_floating_point() else t

    def dtype_of(t):
        return target if target is not None and t.is_floating_point() else t.dtype

    if fmt == "hf":
        producers = spec.hf.weights_to_hf(ck.cfg.model, ck.state)  # {hf name: (shape, () -> tensor)}
        # one dtype for the whole HF folder (its config.json names one): the weights' own, or --dtype
        weights_dtype = dtype_of(next(t for t in ck.state.values() if t.is_floating_point()))
        specs = {name: (shape, weights_dtype) for name, (shape, _) in producers.items()}

        def tensor_of(name):
            t = producers[name][1]()
            return t.to(specs[name][1]) if t.is_floating_point() else t
    else:
        specs = {name: (tuple(t.shape), dtype_of(t)) for name, t in first.items()}

        def tensor_of(name):
            return cast(first[name])
    return specs, tensor_of


def _counted(tensor_of, progress, total: int):
    """tensor_of that calls progress(tensors written, total) before producing each tensor."""
    written = [0]

    def counted(name):
        written[0] += 1
        progress(written[0], total)
        return tensor_of(name)
    return counted


def _write_native_configs(folder: str, ck, arch: str, dtype_name: str, tok, tok_files: list, aliases: dict,
                          counts: dict, metrics: dict) -> None:
    """Write the native folder's config.json and generation_config.json."""
    from data_tools.files import file_checksum

    cfg = ck.cfg
    training = {"config": cfg.to_dict(), "checkpoint": os.path.abspath(ck.checkpoint),
                "step": int(ck.meta["step"]), **metrics}
    _write_json(os.path.join(folder, CONFIG_FILE), {
        "format": FORMAT, "format_version": FORMAT_VERSION, "arch": arch,
        "model": training["config"]["model"], "dtype": dtype_name,
        "tokenizer": tok_files[0] if tok_files else None, "aliases": aliases,
        "checksums": {"algorithm": "xxh3_128", WEIGHTS_FILE: file_checksum(os.path.join(folder, WEIGHTS_FILE))},
        "params": counts, "training": training})
    _write_json(os.path.join(folder, GENERATION_FILE), {
        **SAMPLING, "eos_token_id": tok.eod_id if tok else None,
        "bos_token_id": tok.special_ids().get("bos") if tok else None, "max_length": cfg.model.max_seq_len})


def _copy_tokenizer(folder: str, path, tok, fmt: str, spec) -> list[str]:
    """Copy the tokenizer into the folder; names of the files written."""
    if path is None:
        return []
    if fmt == "hf":
        return spec.hf.write_tokenizer(folder, path, tok)
    name = os.path.basename(path)
    if name in (CONFIG_FILE, WEIGHTS_FILE, GENERATION_FILE, CARD_FILE):
        name = "tokenizer" + os.path.splitext(name)[1]
    shutil.copy2(path, os.path.join(folder, name))
    return [name]


def model_card(cfg, counts: dict, ck, metrics: dict, fmt: str, dtype: str, tok_files: list, adapter,
               command: str) -> str:
    from pretrain.config import to_yaml

    name = os.path.basename(os.path.normpath(ck.run_dir))
    val = (f"{metrics['val_loss']:.4f} nats/token (perplexity {math.exp(min(metrics['val_loss'], 50)):.2f}) "
           f"at step {metrics['val_step']}") if "val_loss" in metrics else "not evaluated during training"
    layout = adapter.layout if fmt == "hf" else "native format"
    load = (adapter.load_line if fmt == "hf" else
            "pretrain generate FOLDER --prompt '...'   |   pretrain eval FOLDER data.valid=[PREFIX]\n"
            "from pretrain.export import load_folder; model, spec, cfg, tokenizer = load_folder(FOLDER)")
    model_yaml = to_yaml(cfg).split("\nparallel:")[0]  # the model section comes first
    return f"""# {name}: {cfg.model.arch}

Exported by recurrent-pretrain from step {ck.meta['step']} of run `{name}`.

| | |
|---|---|
| architecture | `{cfg.model.arch}` ({layout}) |
| parameters | {counts['total']:,} ({counts['embedding']:,} embedding, {counts['non_embedding']:,} non-embedding) |
| training tokens | {metrics['tokens']:,} ({ck.meta['step']} steps) |
| final validation loss | {val} |
| weights | `{WEIGHTS_FILE}`, {dtype} |
| tokenizer | {', '.join(f'`{t}`' for t in tok_files) or 'none (the run trained without one)'} |

## Load

```
{load}
```

## Model config

```yaml
{model_yaml.strip()}
```

## Produced by

```
{command}
```
"""
