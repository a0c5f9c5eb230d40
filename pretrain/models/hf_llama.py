"""The baseline as Hugging Face's LlamaForCausalLM, both ways (the baseline's registry `hf` adapter).

The two are the same function with different names and one layout difference, handled here and not
in the model: RoPE rotates the pairs (x[2i], x[2i+1]) in our attention and the halves (x[i],
x[i + Dh/2]) in transformers' (rotate_half), with the same frequency per i. So the rows of each
head's q and k projections are permuted on the way out (pairs -> halves) and back on the way in;
q.k is unchanged because q and k are permuted alike. Everything else maps name for name: our fused
k|v projection splits into k_proj and v_proj, and a tied head is written once (tie_word_embeddings).

What a Llama folder may hold that the baseline cannot compute is refused by name, one sentence each:
another model_type (Mistral's sliding windows, ...), biases, RoPE scaling, an activation other than
SiLU, a head dimension other than hidden_size / heads.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable

import torch
from torch import Tensor


def pairs_to_halves(w: Tensor, heads: int) -> Tensor:
    """Rows of a q/k projection [heads * Dh, ...] from our interleaved RoPE layout to rotate_half's."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def halves_to_pairs(w: Tensor, heads: int) -> Tensor:
    """The inverse of pairs_to_halves."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).reshape(w.shape)


def _layer_names(i: int) -> dict[str, str]:
    """Our block i's names -> HF's, for the tensors that map one to one."""
    ours, hf = f"blocks.{i}.", f"model.layers.{i}."
    return {ours + "attn_norm.weight": hf + "input_layernorm.weight",
            ours + "attn.proj.weight": hf + "self_attn.o_proj.weight",
            ours + "ffn_norm.weight": hf + "post_attention_layernorm.weight",
            ours + "ffn.gate.weight": hf + "mlp.gate_proj.weight",
            ours + "ffn.up.weight": hf + "mlp.up_proj.weight",
            ours + "ffn.down.weight": hf + "mlp.down_proj.weight"}


class LlamaAdapter:
    model_type = "llama"
    hf_class = "LlamaForCausalLM"
    layout = "Hugging Face Llama layout"  # the model card's words for the folder, and how to load it
    load_line = "transformers.LlamaForCausalLM.from_pretrained(FOLDER)  # local files only"

    # -- export ------------------------------------------------------------------------------
    def check_export(self, cfg) -> None:
        if cfg.window:
            raise ValueError(f"model.window={cfg.window} (sliding-window attention) has no LlamaForCausalLM "
                             "counterpart; export it in the native format")

    def hf_config(self, cfg, dtype: str, tok) -> dict:
        ids = tok.special_ids() if tok is not None else {}
        return {
            "architectures": [self.hf_class], "model_type": self.model_type, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            # transformers 4 reads rope_theta, 5 reads rope_parameters
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
            "bos_token_id": ids.get("bos"), "eos_token_id": tok.eod_id if tok is not None else None,
            "pad_token_id": ids.get("pad"), "torch_dtype": dtype, "use_cache": True,
        }

    def generation_config(self, tok, sampling: dict, suppress: list = ()) -> dict:
        """transformers' generation defaults: the tokenizer's ids, our sampling values, and the ids
        `pretrain generate` never samples (ArchSpec.never_sampled) as suppress_tokens."""
        ids = tok.special_ids() if tok is not None else {}
        return {"bos_token_id": ids.get("bos"), "eos_token_id": tok.eod_id if tok is not None else None,
                "pad_token_id": ids.get("pad"), "do_sample": True,
                **({"suppress_tokens": list(suppress)} if suppress else {}), **sampling}

    def weights_to_hf(self, cfg, state: dict) -> dict[str, tuple[tuple, Callable[[], Tensor]]]:
        """{HF name: (shape, a function making the tensor)}: converted one at a time, when written."""
        H, KV, Dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        out = {"model.embed_tokens.weight": (tuple(state["embed.weight"].shape), lambda: state["embed.weight"])}
        for i in range(cfg.n_layers):
            ours, hf = f"blocks.{i}.attn.", f"model.layers.{i}.self_attn."
            q, kv = state[ours + "q.weight"], state[ours + "kv.weight"]
            out[hf + "q_proj.weight"] = (tuple(q.shape), lambda q=q: pairs_to_halves(q, H))
            half = (KV * Dh, kv.shape[1])
            out[hf + "k_proj.weight"] = (half, lambda kv=kv: pairs_to_halves(kv[: KV * Dh], KV))
            out[hf + "v_proj.weight"] = (half, lambda kv=kv: kv[KV * Dh:])
            for name, hf_name in _layer_names(i).items():
                out[hf_name] = (tuple(state[name].shape), lambda name=name: state[name])
        out["model.norm.weight"] = (tuple(state["norm.weight"].shape), lambda: state["norm.weight"])
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = (tuple(state["head.weight"].shape), lambda: state["head.weight"])
        return out

    def write_tokenizer(self, folder: str, path: str, tok) -> list[str]:
        """The tokenizer as transformers finds it: tokenizer.json (a sentencepiece model converted, so
        that transformers and tokenizers alone load it; the model itself too, as tokenizer.model), with a
        tokenizer_config.json naming its special tokens."""
        import json

        sentencepiece = path.endswith(".model")
        name = "tokenizer.model" if sentencepiece else "tokenizer.json"
        shutil.copy2(path, os.path.join(folder, name))
        written = [name]
        if sentencepiece:
            from data_tools.hf_tokenizer import sentencepiece_to_hf

            sentencepiece_to_hf(path).save(os.path.join(folder, "tokenizer.json"))
            written.append("tokenizer.json")
        ids = tok.special_ids()
        special = {f"{k}_token": tok.id_to_token(i) for k, i in (("bos", ids.get("bos")), ("eos", tok.eod_id),
                                                                 ("unk", ids.get("unk")), ("pad", ids.get("pad")))
                   if i is not None}
        fast = "tokenizer.json" in written
        config = {"tokenizer_class": "PreTrainedTokenizerFast" if fast else "LlamaTokenizer",
                  "add_bos_token": False, "add_eos_token": False, "legacy": False,
                  "split_special_tokens": True, **special}  # "<s>" in text is text, as in ours
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        return [*written, "tokenizer_config.json"]

    # -- import ------------------------------------------------------------------------------
    def model_fields(self, hf: dict) -> dict:
        """The BaselineConfig fields of HF config.json `hf` (of this adapter's model_type: the importer
        picks the adapter by it); ValueError naming what is unsupported."""
        if hf.get("sliding_window"):
            raise ValueError(f"sliding_window={hf['sliding_window']} is not supported: the baseline's Llama block "
                             "attends to the whole context")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"{key}=true is not supported: the baseline's Llama block has no biases")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported: the baseline's FFN is SwiGLU (silu)")
        rope = hf.get("rope_parameters") or {}
        if not all(isinstance(x, dict) for x in (rope, hf.get("rope_scaling") or {})):
            raise ValueError("rope_scaling / rope_parameters is not a mapping")
        for scaling in (hf.get("rope_scaling") or {}, rope):  # transformers 4 names it rope_scaling, 5 rope_parameters
            kind = scaling.get("rope_type") or scaling.get("type") or "default"
            if kind == "default":
                continue
            raise ValueError(f"RoPE scaling ({kind!r}) is not supported: the baseline's RoPE is unscaled")
        try:
            d, heads, layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
            fields = dict(arch="baseline", vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=layers,
                          n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                          ffn_hidden=int(hf["intermediate_size"]),
                          rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
                          norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                          tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                          max_seq_len=int(hf.get("max_position_embeddings") or 4096),
                          init_std=float(hf.get("initializer_range") or 0.02))
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]!r}") from None
        except (TypeError, ValueError):
            raise ValueError("config.json has a non-numeric size field") from None
        if hf.get("head_dim") not in (None, d // heads) or d % heads:
            raise ValueError(f"head_dim={hf.get('head_dim')} is not supported: the baseline's heads are hidden_size / "
                             f"num_attention_heads = {d / heads:g} wide")
        return fields

    def weights_from_hf(self, cfg, names: set, get: Callable[[str], Tensor]) -> dict[str, Tensor]:
        """Our full state dict (every state-dict name, a tied head under both) from the HF tensors
        `names`, read with get(name); ValueError naming a missing or unknown tensor."""
        H, KV = cfg.n_heads, cfg.kv_heads
        used = set()

        def take(name: str) -> Tensor:
            if name not in names:
                raise ValueError(f"the weights have no tensor {name}")
            used.add(name)
            return get(name).float()

        state = {"embed.weight": take("model.embed_tokens.weight")}
        for i in range(cfg.n_layers):
            hf = f"model.layers.{i}.self_attn."
            state[f"blocks.{i}.attn.q.weight"] = halves_to_pairs(take(hf + "q_proj.weight"), H)
            k = halves_to_pairs(take(hf + "k_proj.weight"), KV)
            state[f"blocks.{i}.attn.kv.weight"] = torch.cat([k, take(hf + "v_proj.weight")])
            for name, hf_name in _layer_names(i).items():
                state[name] = take(hf_name)
        state["norm.weight"] = take("model.norm.weight")
        if cfg.tie_embeddings:
            state["head.weight"] = state["embed.weight"]
            used.add("lm_head.weight")  # some tied checkpoints store it too
        else:
            state["head.weight"] = take("lm_head.weight")
        unknown = sorted(n for n in names - used if not n.endswith("rotary_emb.inv_freq"))
        if unknown:
            raise ValueError(f"the weights hold {unknown[0]} (and {len(unknown) - 1} more), which a Llama of this "
                             "config has no place for")
        return state


ADAPTER = LlamaAdapter()
