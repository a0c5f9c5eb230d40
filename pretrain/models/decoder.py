"""The decoder skeleton every architecture here shares: embed -> trunk -> final norm -> head, and the
config fields such a model reads (`DecoderConfig`).

A subclass builds its blocks (pretrain/models/blocks.py) and says, through `applications()`, which
block each step of the trunk applies, in order: a plain stack lists each block once; a looped or
recurrent model lists its shared block several times. The skeleton then provides the training forward
(the model contract of pretrain/models/base.py), full-sequence logits, and a streaming decode whose
cache holds one slot per block application. A subclass knows its effective depth (the number of block
applications) before it builds its blocks, and passes it to their options (`cfg.block_options(depth)`).

The attention mask is a value (kernels.attention.masks): `mask(doc_ids)` gives the causal decoder's
(documents, sliding window); an architecture with a mask of its own overrides it. With
`model.document_mask`, inference follows the training mask too: `logits` and the decode cache read the
documents off the tokens (`doc_ids_of`: a new one after each model.eos_id), as the data path does.
The KV cache, the differentiable GradCache and the dimensions tensor parallelism splits (`tp_dims`)
live here; a registry entry that names no new_state/step/logits gets this skeleton's methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels.attention import Mask, decoder_mask
from kernels.lm_loss import memory_columns
from parallel.layers import LMHead, VocabEmbedding
from parallel.stages import mark_tied
from pretrain.models.base import EVAL, ModelConfig, check_eos_id, continue_doc_ids, doc_ids_of
from pretrain.models.blocks import Attend, BlockOptions, Rope, apply_rope, make_norm, rope_tables
from pretrain.models.units import Run, Unit, Units, unit_modules

__all__ = ["Decoder", "DecoderConfig", "GradCache", "KVCache", "apply_rope", "rope_tables"]


@dataclass
class DecoderConfig(ModelConfig):
    """The fields of a decoder-shaped model (the Transformer++ baseline's, which every decoder here
    shares); `block_options(depth)` turns them into the shared blocks' options, and an architecture
    whose blocks differ (another norm, MLP, biases, positions) overrides it."""

    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 0  # key/value heads, dividing n_heads (grouped-query attention); 0 means n_heads
    ffn_hidden: int = 0  # 0 means 3 * d_model, as in the SPS paper
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    document_mask: bool = False  # attend only within a document of the packed sample
    eos_id: int = 2  # the tokenizer's end of a document: where inference starts a new one (model.document_mask)
    window: int = 0  # sliding attention window in keys, the query's own included (0 = unlimited)
    init_std: float = 0.02
    # > 0: the training loss this many positions at a time, its gradient computed in the forward
    # (kernels/lm_loss "chunked"): no [tokens, vocab] logits kept; 0: all at once (the reference)
    loss_chunk: int = 0

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 3 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def block_options(self, depth: int) -> BlockOptions:
        """The shared blocks' options for a model applying `depth` blocks per token (Llama's block:
        RMSNorm, SwiGLU, no biases, RoPE, only the attention output's init scaled by depth)."""
        return BlockOptions(d_model=self.d_model, n_heads=self.n_heads, kv_heads=self.kv_heads, ffn=self.ffn,
                            norm_eps=self.norm_eps, init_std=self.init_std, depth=depth)

    def validate(self) -> None:
        super().validate()
        for name in ("d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden must be positive (or 0 for 3 * d_model), got {self.ffn_hidden}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by model.n_heads {self.n_heads}")
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads {self.n_kv_heads} must divide model.n_heads {self.n_heads} "
                             "(or be 0 for n_heads)")
        if self.loss_chunk < 0:
            raise ValueError(f"model.loss_chunk must be >= 0 (positions per chunk of the loss; 0 = all at once), "
                             f"got {self.loss_chunk}")
        if self.window < 0:
            raise ValueError(f"model.window must be >= 0 (0 = unlimited attention), got {self.window}")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise ValueError("model.norm_eps, model.rope_theta and model.init_std must be positive")
        check_eos_id(self, "document_mask")
        self.block_options(1).validate()

    def validate_run(self, run) -> None:
        """With document masks, model.eos_id is the tokenizer's end of a document (inference reads the
        documents off the tokens where training reads them from the data)."""
        super().validate_run(run)
        check_eos_id(self, "document_mask", run)


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
        self.doc: Tensor | None = None  # [B, max_len] document ids, under document masks (documents())

    def documents(self, tokens: Tensor, eos_id: int) -> Tensor:
        """Document ids [B, length + n] of every cached position and of the new tokens [B, n], which are
        recorded (a new document after each eos_id, as in the data)."""
        B, n = tokens.shape
        if self.doc is None:
            self.doc = torch.zeros(B, self.max_len, dtype=torch.long, device=tokens.device)
            self.next_doc = torch.zeros(B, dtype=torch.long, device=tokens.device)
        self.doc[:, self.length:self.length + n], self.next_doc = continue_doc_ids(tokens, eos_id, self.next_doc)
        return self.doc[:, :self.length + n]

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


class Decoder(Units, nn.Module):
    """embed -> applications() -> norm -> head, with the RoPE tables; see the module docstring.
    The config is a DecoderConfig (or derives from it)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        options = cfg.block_options(1)
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std)
        self.norm = self.make_norm(cfg.d_model)
        self.head = LMHead(cfg.d_model, cfg.vocab_size, tied=self.embed if cfg.tie_embeddings else None,
                           init_std=cfg.init_std, loss_chunk=cfg.loss_chunk)
        self.rope = Rope(options.head_dim, cfg.max_seq_len, cfg.rope_theta) if options.positions == "rope" else None

    def rope_device(self) -> torch.device:
        """The model's device (any parameter's: a pipeline stage holds only some)."""
        return next(self.parameters()).device

    def make_norm(self, dim: int) -> nn.Module:
        """A norm of the block family (its options' `norm`: RMSNorm or LayerNorm)."""
        return make_norm(self.cfg.block_options(1).norm, dim, self.cfg.norm_eps)

    def mask(self, doc_ids: Tensor | None = None) -> Mask:
        """The attention mask of a training forward: causal, within documents when doc_ids is given,
        within model.window keys. Decode uses the same value with the cache's offset."""
        return decoder_mask(doc_ids, self.cfg.window or None)

    def attend(self, positions: Tensor, mask: Mask, cache=None) -> Attend:
        """The value every block attends with: the mask, the RoPE tables at `positions`, the cache."""
        return Attend(mask, self.rope.at(positions) if self.rope is not None else None, cache)

    def applications(self) -> list[nn.Module]:
        """The blocks the trunk applies, in order (a shared block appears once per application)."""
        raise NotImplementedError

    def units(self) -> list[Unit]:
        """The trunk as units (pretrain/models/units.py): by default block application i, reading decode
        cache slot i; a model whose trunk has other steps (CART's loop) lists its own."""
        return [Unit.block(block, slot) for slot, block in enumerate(self.applications())]

    def inputs(self, tokens: Tensor, positions: Tensor, doc_ids: Tensor | None, cache=None) -> tuple[Tensor, Attend]:
        """What the trunk embeds and the value every block attends with, for tokens [B, T] at positions
        [B, T] within documents doc_ids (None: no document mask); SPS builds its slots here."""
        return tokens, self.attend(positions, self.mask(doc_ids), cache)

    def hidden(self, tokens: Tensor, positions: Tensor, doc_ids: Tensor | None = None, cache=None) -> Tensor:
        """The head's input [B, T, d] for tokens [B, T] at positions [B, T] within documents doc_ids (None:
        no document mask); with a decode cache, after its positions (the cache is extended)."""
        x, a = self.inputs(tokens, positions, doc_ids, cache)
        h = self.readout(self.apply_units(self.embed(x), Run(a, EVAL, cache=cache)), tokens.shape[1])
        if cache is not None:
            cache.length += tokens.shape[1]
        return h

    def body(self, tokens: Tensor, positions: Tensor, mask: Mask, cache=None, loops: int | None = None) -> Tensor:
        """Hidden states [B, T, d] after the last unit, before the final norm (a model that reads out only
        some positions norms those alone); `loops`: a depth override at inference (CART's R)."""
        run = Run(self.attend(positions, mask, cache), EVAL, cache=cache, loops=loops)
        return self.apply_units(self.embed(tokens), run)

    def forward(self, batch, ctx=EVAL) -> tuple[Tensor, dict]:
        """Mean next-token loss over the batch's loss_mask, and the units' diagnostics."""
        return self.run_stage(batch, ctx, None, 0, self.pipeline_units(), last=True)

    # -- pipeline stages (parallel/pipeline.py): a stage is a run of units -------------------------------
    def stage_inputs(self, batch) -> tuple[Tensor, Attend]:
        """What the first stage embeds and the value every block attends with: each stage builds the
        latter from the batch (masks and RoPE tables are values, not activations to send)."""
        return self.inputs(batch.tokens, batch.positions, batch.doc_ids if self.cfg.document_mask else None)

    def stage_output(self, h: Tensor, batch) -> tuple[Tensor, dict]:
        """The last stage's end, from the last unit's output: the read-out, head and loss."""
        return self.head.loss(self.readout(h, batch.tokens.shape[1]), batch.labels, batch.loss_mask), {}

    def run_stage(self, batch, ctx, h: Tensor | None, lo: int, hi: int, last: bool) -> tuple[Tensor, dict]:
        """Units [lo, hi) on h (None: the embedded tokens, for the first stage); the loss and diagnostics
        when `last`, else the hidden states for the next stage and diagnostics."""
        tokens, a = self.stage_inputs(batch)
        run = Run(a, ctx)
        h = self.apply_units(self.embed(tokens) if h is None else h, run, lo, hi)
        if not last:
            return h, run.diagnostics
        loss, diagnostics = self.stage_output(h, batch)
        return loss, {**run.diagnostics, **diagnostics}

    def compile_blocks(self, **kwargs) -> None:
        """train.compile_scope=blocks (torchtitan's per-block compile): each distinct block compiled on its own
        and the read-out (final norm, head, loss) apart. Blocks of one class share one compiled graph (dynamo
        treats their parameters as inputs), so compiling costs about one block instead of the whole depth;
        what is lost is fusion across a block's boundary. The embedding (a gather) runs as written."""
        for module in unit_modules(self):
            module.compile(**kwargs)
        self.stage_output = torch.compile(self.stage_output, **kwargs)

    def drop_ends(self, first: bool, last: bool) -> None:
        """The embedding off the first stage, the final norm and head off the last; a tied weight marked
        (a head tied to the embedding keeps its own reference to the weight on the last stage; the pipeline
        engine sums the two copies' gradients)."""
        if self.cfg.tie_embeddings:
            mark_tied((self.embed if first else self.head).weight, "embed.weight")
        if not first:
            self.embed = None
        if not last:
            self.norm = self.head = None

    def ends(self) -> tuple:
        """What the ends own (the embedding, the final norm, the head): every other parameter is a unit's."""
        return self.embed, self.norm, self.head

    def inference_doc_ids(self, tokens: Tensor) -> Tensor | None:
        """The document ids training would mask tokens [B, T] by (None without model.document_mask)."""
        return doc_ids_of(tokens, self.cfg.eos_id) if self.cfg.document_mask else None

    def logits(self, tokens: Tensor) -> Tensor:
        """Full-sequence logits [B, T, V] (float32) of tokens [B, T], each row from position 0 (under
        model.document_mask, a new document after each EOS)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head.logits(self.hidden(tokens, positions, self.inference_doc_ids(tokens)))

    def readout(self, h: Tensor, T: int) -> Tensor:
        """The head's input from the last unit's output over T input tokens: the final norm (SPS reads
        out one half of its slots)."""
        return self.norm(h)

    def new_state(self, batch_size: int) -> KVCache:
        p, o = self.embed.weight, self.cfg.block_options(1)
        return KVCache(len(self.applications()), batch_size, o.kv_heads, self.cfg.max_seq_len, o.head_dim,
                       p.device, p.dtype)

    def step(self, tokens: Tensor, state: KVCache) -> tuple[Tensor, KVCache]:
        """Feed tokens [B, n] after the cached ones; logits [B, n, V] (float32)."""
        n = tokens.shape[1]
        if state.length + n > state.max_len:
            raise ValueError(f"generation would exceed model.max_seq_len {state.max_len}")
        positions = torch.arange(state.length, state.length + n, device=tokens.device).expand(tokens.shape[0], n)
        doc_ids = state.documents(tokens, self.cfg.eos_id) if self.cfg.document_mask else None
        return self.head.logits(self.hidden(tokens, positions, doc_ids, state)), state


def pipeline_split(cfg, pp: int) -> list[int]:
    """Stage boundaries of a decoder (its registry `pipeline_split`): n_layers blocks in pp equal runs."""
    L = cfg.n_layers
    if L % pp:
        raise ValueError(f"model.n_layers={L} does not split into {pp} pipeline stages of equal depth (parallel.pp x "
                         "parallel.virtual_stages)")
    return [i * L // pp for i in range(pp + 1)]


def activation_bytes(cfg, seq_len: int, batch: int, recompute: str = "none") -> int:
    """Peak bytes of one micro batch's activations over its forward and backward, fp32, for a decoder
    whose blocks are the shared pre-norm attention + SwiGLU blocks applied once each (the baseline's;
    its registry `activation_bytes`, read by the planner). In columns of N = batch x seq_len fp32
    numbers, fitted to what tests/test_plan.py measures (each coefficient a sum of saved tensors):
      a block keeps 12.25 d + 4.2 f (its two norms' inputs and outputs, q, k, v and the rotated q and k,
        the attention output, the SwiGLU's gate, up, activation and product; flash-style attention
        keeps no T x T scores), or its input alone (1.8 d) under recompute;
      the embedding and final norm keep 4.25 d, the loss what kernels/lm_loss.memory_columns says (the
        fp32 logits, V, or under model.loss_chunk the gradient of the head's input);
      the backward adds the loss's peak (the logits' gradient and softmax, 2 V, or one chunk's) or,
        under recompute, one block recomputed (12.25 d + 4.2 f + 2 d) when that is larger.
    The parameters and their gradients are left out (the planner counts them apart)."""
    d, f, V, L = cfg.d_model, cfg.ffn, cfg.vocab_size, cfg.n_layers
    block = 12.25 * d + 4.2 * f
    kept = block if recompute == "none" else 1.8 * d
    loss_kept, loss_peak = memory_columns(V, d, batch * seq_len, cfg.loss_chunk)
    if recompute == "none":
        at_peak = loss_kept + loss_peak
    else:  # the recomputed block comes after the loss's backward, which frees what the loss kept
        at_peak = max(loss_kept + loss_peak, block + 2 * d)
    return int(4 * batch * seq_len * (4.25 * d + L * kept + at_peak))


def tp_dims(cfg) -> dict[str, int]:
    """The dimensions tensor parallelism splits in a decoder-shaped config (its registry `tp_dims`):
    query and key/value heads, the FFN width and the vocabulary."""
    return {"model.n_heads": cfg.n_heads, "model.n_kv_heads": cfg.kv_heads, "model.ffn_hidden": cfg.ffn,
            "model.vocab_size": cfg.vocab_size}
