"""The decoder skeleton every architecture here shares: embed -> trunk -> final norm -> head.

A subclass builds its blocks and says, through `applications()`, which block each step of the trunk
applies, in order: a plain stack lists each block once; a looped or recurrent model lists its shared
block several times. The skeleton then provides the training forward (the model contract of
pretrain/models/base.py), full-sequence logits, and a streaming decode whose cache holds one slot per
block application (a registry entry that names no new_state/step/logits gets these methods). A
subclass knows its effective depth (the number of block applications) before it builds its blocks,
and passes it to their initialisation.

Pieces more than one architecture uses live here too: the RoPE tables, the KV cache and the
dimensions tensor parallelism splits (`tp_dims`; RMSNorm is a parallel.layers facade: it marks itself
for sequence parallelism).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from parallel.layers import LMHead, RMSNorm, VocabEmbedding
from pretrain.models.base import EVAL


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, head_dim / 2] for rotating the pairs (x[2i], x[2i+1]) (Llama's layout)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, Dh]; cos, sin [B, 1, T, Dh/2] already gathered at the tokens' positions."""
    pairs = (x if x.dtype == torch.float64 else x.float()).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class KVCache:
    """Keys and values for streaming decode, one slot per block application, [B, H_kv, max_len, Dh]
    each (H_kv key/value heads: fewer than the query heads under grouped-query attention), filled to
    `length` (a block applied three times per token keeps three slots)."""

    def __init__(self, slots: int, batch_size: int, heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (batch_size, heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(slots)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(slots)]
        self.length = 0
        self.max_len = max_len

    def extend(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Write new keys/values [B, H, n, Dh] after the `length` cached ones (in place: writing the
        same positions again, before `length` advances, overwrites them) and return every key and
        value so far plus the number of cached positions before the new ones."""
        start, n = self.length, k.shape[2]
        self.k[slot][:, :, start:start + n] = k
        self.v[slot][:, :, start:start + n] = v
        return self.k[slot][:, :, :start + n], self.v[slot][:, :, :start + n], start


class GradCache:
    """A KV cache autograd can differentiate through (training a recurrence step by step, CRT's BPTT):
    keys and values are kept as a list of tensors and concatenated, never written in place. With a
    sliding `window` only the last `window` positions are kept, so memory stays O(T * window)."""

    def __init__(self, slots: int, window: int = 0):
        self.k: list[list[Tensor]] = [[] for _ in range(slots)]
        self.v: list[list[Tensor]] = [[] for _ in range(slots)]
        self.window = window
        self.length = 0

    def extend(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        ks, vs = self.k[slot], self.v[slot]
        ks.append(k)
        vs.append(v)
        if self.window and len(ks) > self.window:
            del ks[0], vs[0]
        keys, values = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        return keys, values, keys.shape[2] - k.shape[2]


class Decoder(nn.Module):
    """embed -> applications() -> norm -> head, with RoPE tables; see the module docstring.

    The config needs vocab_size, d_model, n_heads, kv_heads, head_dim, max_seq_len, rope_theta,
    norm_eps, tie_embeddings, document_mask and init_std (pretrain/models/baseline.py's BaselineConfig
    has them).
    """

    def __init__(self, cfg):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std)
        self.norm = self.make_norm(cfg.d_model)
        self.head = LMHead(cfg.d_model, cfg.vocab_size, tied=self.embed if cfg.tie_embeddings else None,
                           init_std=cfg.init_std)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def make_norm(self, dim: int) -> nn.Module:
        """The norm of the block family (RMSNorm here; GPT-2-style blocks use parallel.layers.LayerNorm)."""
        return RMSNorm(dim, self.cfg.norm_eps)

    def applications(self) -> list[nn.Module]:
        """The blocks the trunk applies, in order (a shared block appears once per application)."""
        raise NotImplementedError

    def hidden(self, tokens: Tensor, positions: Tensor, doc_ids: Tensor | None = None,
               cache: KVCache | None = None) -> Tensor:
        """Final-normed hidden states [B, T, d] of tokens [B, T] at positions [B, T]."""
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        h = self.embed(tokens)
        for slot, block in enumerate(self.applications()):
            h = block(h, cos, sin, doc_ids, cache, slot)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.norm(h)

    def forward(self, batch, ctx=EVAL) -> tuple[Tensor, dict]:
        """Mean next-token loss over the batch's loss_mask, and diagnostics (none here)."""
        doc_ids = batch.doc_ids if self.cfg.document_mask else None
        h = self.hidden(batch.tokens, batch.positions, doc_ids)
        return self.head.loss(h, batch.labels, batch.loss_mask), {}

    def logits(self, tokens: Tensor) -> Tensor:
        """Full-sequence logits [B, T, V] (float32) of tokens [B, T], each row one document from position 0."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head.logits(self.hidden(tokens, positions))

    def new_state(self, batch_size: int) -> KVCache:
        p, cfg = self.embed.weight, self.cfg
        return KVCache(len(self.applications()), batch_size, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim,
                       p.device, p.dtype)

    def step(self, tokens: Tensor, state: KVCache) -> tuple[Tensor, KVCache]:
        """Feed tokens [B, n] after the cached ones; logits [B, n, V] (float32)."""
        n = tokens.shape[1]
        if state.length + n > state.max_len:
            raise ValueError(f"generation would exceed model.max_seq_len {state.max_len}")
        positions = torch.arange(state.length, state.length + n, device=tokens.device).expand(tokens.shape[0], n)
        return self.head.logits(self.hidden(tokens, positions, None, state)), state


def tp_dims(cfg) -> dict[str, int]:
    """The dimensions tensor parallelism splits in a decoder-shaped config (its registry `tp_dims`):
    query and key/value heads, the FFN width and the vocabulary."""
    return {"model.n_heads": cfg.n_heads, "model.n_kv_heads": cfg.kv_heads, "model.ffn_hidden": cfg.ffn,
            "model.vocab_size": cfg.vocab_size}
