"""The transformers face of an exported model: the pieces every generated remote-code file ends with.

`PretrainHFConfig` carries the project's model config (`pretrain_model`: the fields of the architecture's
config dataclass) beside the fields transformers itself reads. `PretrainForCausalLM` builds the project's
model from it (the generated file names the config dataclass and the model class: `MODEL_CONFIG`,
`MODEL`) and gives it the causal-LM interface:

- `forward(input_ids)` -> logits of the whole sequence (the model's `logits`: the training mask, CRT's
  evaluation passes, CART's R, SPS's predict slots, exactly as `pretrain eval` computes them), and the
  mean next-token loss when `labels` are given;
- `generate(...)` streams through the model's own state (its `new_state` / `step`, as `pretrain generate`
  does): the prompt in one step, then one token per step. The state travels as `state` (an output field
  and a model keyword), never as transformers' KV cache, so each architecture keeps its own (RT's and
  GPN's are a fixed size). Beam search and padded batches are refused in one sentence: the state has no
  reordering and the models have no notion of a padded position.

This module is a piece of the remote code (pretrain/hf_remote/generate.py); it is tested through the
generated files, never imported by the project itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch.nn import functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

_V5 = int(transformers.__version__.split(".")[0]) >= 5


class PretrainHFConfig(PretrainedConfig):
    model_type = "pretrain"

    def __init__(self, pretrain_model: dict | None = None, pretrain_aliases: dict | None = None, **kwargs):
        self.pretrain_model = dict(pretrain_model or {})
        self.pretrain_aliases = dict(pretrain_aliases or {})  # {weight name: the name it is tied to}
        kwargs.setdefault("vocab_size", self.pretrain_model.get("vocab_size"))
        kwargs.setdefault("max_position_embeddings", self.pretrain_model.get("max_seq_len"))
        super().__init__(**kwargs)


class Streamed:
    """The model's own streaming state and how many tokens of the sequence it has consumed."""

    def __init__(self, state, fed: int):
        self.state, self.fed = state, fed


@dataclass
class PretrainOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    state: Any = None


def _refuse_padding(attention_mask) -> None:
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("this model takes no padded batches (an attention_mask with zeros): its state has no "
                         "notion of a padded position; score or generate one sequence, or sequences of one length, "
                         "at a time (lm-evaluation-harness: batch_size=1)")


class PretrainForCausalLM(PreTrainedModel, GenerationMixin):
    base_model_prefix = "pretrain"
    main_input_name = "input_ids"
    _no_split_modules: list = []
    _is_stateful = True  # no assisted decoding or contrastive search: the state cannot be rolled back
    MODEL_CONFIG = None  # the project's config dataclass and model class (set by the generated file)
    MODEL = None

    def __init__(self, config):
        super().__init__(config)
        with torch.device("cpu"):  # the project's own init, whole (its RoPE and ALiBi tables are buffers)
            self.model = type(self).MODEL(type(self).MODEL_CONFIG(**config.pretrain_model))
        # Non-persistent buffers (RoPE tables, ALiBi slopes) as built: transformers 5 loads into a model made on
        # the meta device and re-creates the buffers that the folder does not hold, then asks _init_weights
        self._built = {id(m): {n: b.detach().clone() for n, b in m._buffers.items()
                               if b is not None and n in m._non_persistent_buffers_set} for m in self.model.modules()}
        # {alias: source}: from the config, as identity does not survive transformers 4's meta-device init
        self._tied = {f"model.{k}": f"model.{v}" for k, v in config.pretrain_aliases.items()}
        self._tied_weights_keys = dict(self._tied) if _V5 else list(self._tied)
        self.post_init()

    def _init_weights(self, module):
        """Every weight comes from the folder; a computed buffer gets its value as built back, on the device
        transformers placed the buffer on (device_map="cuda" makes it there, empty, before asking)."""
        for name, value in self._built.get(id(module), {}).items():
            now = module._buffers.get(name)
            device = now.device if now is not None and now.device.type != "meta" else value.device
            module._buffers[name] = value.to(device, copy=True)

    def tie_weights(self, *args, **kwargs):
        if _V5:  # transformers 5 ties by `_tied_weights_keys` {alias: source} itself
            return super().tie_weights(*args, **kwargs)
        for name, source in self._tied.items():  # 4.x ties only what get_output_embeddings names: every alias
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, self.get_parameter(source))

    def get_input_embeddings(self):
        return getattr(self.model, "embed", None)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own state (`state`), not a transformers Cache

    def forward(self, input_ids: torch.LongTensor, attention_mask=None, state=None, labels=None, use_cache=None,
                return_dict=None, **kwargs):
        _refuse_padding(attention_mask)
        if state is None and not use_cache:
            logits = self.model.logits(input_ids)
        else:
            if state is None:
                state = Streamed(self.model.new_state(input_ids.shape[0]), 0)
            logits, inner = self.model.step(input_ids, state.state)
            state = Streamed(inner, state.fed + input_ids.shape[1])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return PretrainOutput(loss=loss, logits=logits, state=state)

    def prepare_inputs_for_generation(self, input_ids, state=None, attention_mask=None, **kwargs):
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("this model generates from input_ids only, not inputs_embeds")
        if state is not None:  # the state holds every earlier token: feed the newest alone
            input_ids = input_ids[:, state.fed:]
        return {"input_ids": input_ids, "state": state, "attention_mask": attention_mask, "use_cache": True}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, **kwargs):
        model_kwargs["state"] = outputs.state
        mask = model_kwargs.get("attention_mask")
        if mask is not None:
            model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        return model_kwargs

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1:
            raise ValueError(BEAMS)
        return super().generate(*args, **kwargs)

    def _reorder_cache(self, *args, **kwargs):
        raise ValueError(BEAMS)


BEAMS = "beam search is not supported: the model's state cannot be reordered (num_beams=1)"

