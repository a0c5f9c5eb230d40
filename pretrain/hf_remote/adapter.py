"""The `hf` registry adapter of an architecture that transformers does not have: its `--format hf` folder
carries its own code (trust_remote_code), generated from the project's (pretrain/hf_remote/generate.py).

The folder: config.json (model_type `pretrain_<arch>`, an `auto_map` naming the two shipped files, the
architecture's model config under `pretrain_model`), configuration_<arch>.py and modeling_<arch>.py, the
weights under the state-dict names of the project's model prefixed by `model.` (a tied head written
once), the tokenizer as the baseline's Llama folder has it. `pretrain import` reads such a folder back.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import Tensor

PREFIX = "model."


class RemoteAdapter:
    remote = True  # the folder ships code (pretrain/hf_remote/generate.py lists these architectures)

    def __init__(self, arch: str):
        from pretrain.hf_remote.generate import class_names, file_names

        self.arch = arch
        self.model_type = f"pretrain_{arch}"
        self.config_class, self.hf_class = class_names(arch)
        self.files = file_names(arch)
        self.auto_map = {"AutoConfig": f"{self.files[0][:-3]}.{self.config_class}",
                         "AutoModelForCausalLM": f"{self.files[1][:-3]}.{self.hf_class}"}
        self.load_line = ("transformers.AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)\n"
                          "transformers.AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True)\n"
                          "# torch and transformers only; batch size 1 or unpadded batches, greedy or sampling")
        self.layout = "its own code, for transformers' trust_remote_code"

    # -- export ------------------------------------------------------------------------------
    def check_export(self, cfg) -> None:
        """Nothing to refuse: the remote code is the model's own, so every model.* option is represented."""

    def hf_config(self, cfg, dtype: str, tok) -> dict:
        from pretrain.models import meta_model

        ids = tok.special_ids() if tok is not None else {}
        aliases = _aliases(meta_model(cfg))
        return {"architectures": [self.hf_class], "model_type": self.model_type, "auto_map": self.auto_map,
                "pretrain_model": dataclasses.asdict(cfg), "pretrain_aliases": aliases, "vocab_size": cfg.vocab_size,
                "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": bool(aliases),
                "bos_token_id": ids.get("bos"), "eos_token_id": tok.eod_id if tok is not None else None,
                "pad_token_id": ids.get("pad"), "torch_dtype": dtype, "use_cache": True}

    def generation_config(self, tok, sampling: dict, suppress: list = ()) -> dict:
        from pretrain.models.hf_llama import ADAPTER  # the same file as the baseline's Llama folder

        return ADAPTER.generation_config(tok, sampling, suppress)

    def write_tokenizer(self, folder: str, path: str, tok) -> list[str]:
        from pretrain.models.hf_llama import ADAPTER  # the same files as the baseline's Llama folder

        return ADAPTER.write_tokenizer(folder, path, tok)

    def remote_files(self) -> dict[str, str]:
        from pretrain.hf_remote.generate import shipped

        return shipped(self.arch)

    def weights_to_hf(self, cfg, state: dict) -> dict[str, tuple[tuple, Callable[[], Tensor]]]:
        from pretrain.models import meta_model

        aliases = _aliases(meta_model(cfg))
        return {PREFIX + name: (tuple(t.shape), lambda t=t: t) for name, t in state.items() if name not in aliases}

    # -- import ------------------------------------------------------------------------------
    def model_fields(self, hf: dict) -> dict:
        from pretrain.models import get_arch

        fields = hf.get("pretrain_model")
        if not isinstance(fields, dict):
            raise ValueError(f"config.json of model_type {self.model_type!r} has no `pretrain_model` mapping")
        if hf.get("auto_map") != self.auto_map:
            raise ValueError(f"config.json's auto_map {hf.get('auto_map')} is not {self.auto_map}, the remote code of "
                             f"model.arch={self.arch}")
        known = {f.name for f in dataclasses.fields(get_arch(self.arch).config_cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"config.json's pretrain_model has {unknown[0]!r}, not a field of model.arch={self.arch}")
        if fields.get("arch") != self.arch:
            raise ValueError(f"config.json's pretrain_model.arch {fields.get('arch')!r} is not {self.arch!r} "
                             f"(model_type {self.model_type})")
        return dict(fields)

    def weights_from_hf(self, cfg, names: set, get: Callable[[str], Tensor]) -> dict[str, Tensor]:
        from pretrain.models import meta_model

        meta = meta_model(cfg)
        aliases = _aliases(meta)
        shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        state = {}
        for name, shape in shapes.items():
            if name in aliases:
                continue
            if PREFIX + name not in names:
                raise ValueError(f"the weights have no tensor {PREFIX + name}")
            t = get(PREFIX + name)
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor {PREFIX + name} has shape {tuple(t.shape)}, but the config's model has "
                                 f"{shape}")
            state[name] = t
        unknown = sorted(names - {PREFIX + n for n in state} - {PREFIX + a for a in aliases})
        if unknown:
            raise ValueError(f"the weights hold {unknown[0]} (and {len(unknown) - 1} more), which a "
                             f"model.arch={self.arch} of this config has no place for")
        for alias, first in aliases.items():
            state[alias] = state[first]
        return state


def _aliases(model) -> dict[str, str]:
    from pretrain.export.source import tied_aliases

    return tied_aliases(model)

