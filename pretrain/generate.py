"""Sampling from a trained model through its architecture's streaming decode (new_state / step).

Only the registry's `new_state` and `step` are used, so every architecture generates the same way,
and the cached decode is the function its parallel forward computes (tests hold them equal).
"""
from __future__ import annotations

import torch
from torch import Tensor


def filter_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Scaled logits with everything outside the top-k and the top-p nucleus set to -inf."""
    logits = logits.float() / max(temperature, 1e-6)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first
        # token is always kept).
        drop_sorted = probs.cumsum(-1) - probs > top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


@torch.no_grad()
def generate(model, spec, prompt: list[list[int]], max_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             pad_id: int | None = None) -> list[list[int]]:
    """Continue each prompt (equal lengths) by up to max_tokens tokens; temperature 0 is greedy. A row stops
    at eos_id; pad_id (the tokenizer's) is never sampled, unless it is eos_id too."""
    if not prompt or not prompt[0]:
        raise ValueError("generation needs a non-empty prompt")
    device = next(model.parameters()).device
    tokens = torch.tensor(prompt, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    never = spec.never_sampled(model.cfg, eos_id, pad_id)
    state = spec.new_state(model, tokens.shape[0])
    logits, state = spec.step(model, tokens, state)
    out = [[] for _ in prompt]
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    for k in range(max_tokens):
        last = logits[:, -1]
        if never:
            last = last.index_fill(-1, torch.tensor(never, device=device), float("-inf"))
        if temperature == 0:
            nxt = last.argmax(-1)
        else:
            probs = filter_logits(last, temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
        for row, tok in enumerate(nxt.tolist()):
            if not done[row]:
                out[row].append(tok)
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        if k + 1 < max_tokens:  # the last token needs no logits after it
            logits, state = spec.step(model, nxt[:, None], state)
    return out


def load_for_inference(path: str, device: str = "cpu", overrides: list[str] | tuple = (), log=print,
                       need: tuple = ("tokenizer",)):
    """(model, spec, config, tokenizer or None) from a run directory (its latest usable checkpoint,
    falling back past corrupt ones with a line), a checkpoint directory (a corrupt file is an error
    naming it) or an exported folder (pretrain/export/loader.py). The stored config's paths are found
    where the run now is (pretrain/runs.py), then `overrides` apply (only those that keep the trained weights, see runs.check_inference_overrides),
    then the data files `need` names are checked (DataConfig.check_files)."""
    from pretrain.export.loader import is_export_folder, load_folder

    given = {f for f in ("train.threads", "train.device", "train.compile")
             if any(o.startswith(f + "=") for o in overrides)}  # runtime settings, as train takes them
    device = _inference_device(overrides, device)
    if is_export_folder(path):  # a folder written by `pretrain export` (torch and safetensors only)
        return _runtime(*load_folder(path, device, overrides, log, need), given)
    from data_tools.tokenizer import load_tokenizer
    from pretrain.checkpoint import load_checkpoint, load_latest
    from pretrain.config import config_from_dict
    from pretrain.models import get_arch
    from pretrain.readers import read_with_fallback
    from pretrain.runs import check_inference_overrides, stored_config

    def read(ckpt: str, is_run: bool):  # again from a newer checkpoint if a trainer prunes this one meanwhile
        meta, cfg, _ = stored_config(ckpt, log)
        check_inference_overrides(meta["config"], overrides)
        cfg = config_from_dict(cfg.to_dict(), overrides=overrides)
        cfg.data.check_files(need)
        spec = get_arch(cfg.model.arch)
        with torch.device(device):  # initialised, then overwritten by the checkpoint's weights
            model = spec.build(cfg.model)
        if cfg.train.precision == "fp64":  # a numerical-check run's weights keep every digit at inference too
            model = model.double()
        kw = dict(optimizer=None, restore_rng=False, expect_arch=cfg.model.arch, verify=cfg.checkpoint.verify,
                  log=log)
        if is_run:  # load_latest says why when it falls back past a corrupt checkpoint
            load_latest(path, model, start=ckpt, **kw)
        else:
            load_checkpoint(ckpt, model, **kw)
        return model, spec, cfg

    model, spec, cfg = read_with_fallback(path, read, log)
    model.eval()
    tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    return _runtime(model, spec, cfg, tokenizer, given)


def _inference_device(overrides, default: str) -> str:
    """train.device=auto|cpu|cuda from the command line (the stored one is the training machine's)."""
    value = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.device=")), None)
    if value is None:
        return default
    if value not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device must be auto, cpu or cuda, got {value!r}")
    from types import SimpleNamespace

    from pretrain.trainer import resolve_device  # the trainer's rule: auto picks CUDA when there is one

    return str(resolve_device(SimpleNamespace(device=value)))


def _runtime(model, spec, cfg, tokenizer, given: set):
    """train.threads and train.compile, applied when the command line gives them."""
    if "train.threads" in given and cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    if "train.compile" in given and cfg.train.compile:
        model.compile()
    return model, spec, cfg, tokenizer
