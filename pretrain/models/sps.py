"""State-Prediction Separation (spec-001; Monea et al. 2026): a `<predict>` slot after every input token.

The input x_1..x_T becomes the 2T slots (x_1, ρ_1, ..., x_T, ρ_T), ρ being the tokenizer's reserved
`<predict>` token; x_i and ρ_i share RoPE position i, and the next-token loss is read from one kind of
slot only. The attention mask separates a token's two jobs: one kind of slot is persistent (every later
slot of its document attends to it: the state, the KV cache kept forever), the other is windowed
(visible only to queries at most w tokens later: a (w+1)-entry ring in decode). Both streams share every
weight; `<predict>`'s embedding row is the only new parameter. The variants (model.variant) differ only
in which kind is persistent and where the logits are read (spec §2.7):

    variant        persistent   windowed   logits from
    sps            x            ρ          ρ_i
    delayed_state  ρ            x          ρ_i
    reverse_sps    ρ            x          x_i
    2x_memory      x and ρ      none       ρ_i     (SPS with w = infinity: causal over the 2T slots)

Standard is the baseline (configs/baseline). A query slot q may attend to a key slot k when k comes
no later than q in the interleaved order (2 tok + kind), both are in the same document, and k is
persistent or at most w tokens back (spec §2.3, Eq. 5: x_i sees w windowed keys, ρ_i w + 1 with itself).

Layout: the interleaved order is the definition; inside the model the slots are de-interleaved,
[x_1..x_T | ρ_1..ρ_T], and the mask reads each slot's token index, kind and document from tables
(`SlotMask`), so the windowed half's keys form a band that block-sparse kernels skip (spec §5 item 6).
Norms and MLPs act per slot, so the permutation changes no value (tests/test_sps.py, T6). The final
norm and the head run on the read-out half only.

Decode (`SPSState`): per layer one buffer [ring of w + 1 windowed keys | persistent keys], written in
place for one-token steps; the mask's key tables say which entry is which, and a document's keys are
masked for every later document (the cache reset after EOS, row by row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from data_tools.tokenizer import PREDICT_PIECE
from kernels.attention import Mask
from kernels.attention import measured as attention_measured
from kernels.attention.masks import document_bounds
from kernels.lm_loss import memory_columns
from parallel.layers import gather_sequence, local_sequence
from pretrain.models import decoder
from pretrain.models.base import continue_doc_ids, tokenizer_ids
from pretrain.models.blocks import Block
from pretrain.models.decoder import Decoder, DecoderConfig
from pretrain.hf_remote.adapter import RemoteAdapter
from pretrain.models.registry import ArchSpec, Support, register
from pretrain.models.units import unit_modules

X, RHO = 0, 1  # slot kinds: the input token, its <predict> slot
# variant -> (the persistent kind, None for both; the kind the logits are read from)
VARIANTS = {"sps": (X, RHO), "delayed_state": (RHO, RHO), "reverse_sps": (RHO, X), "2x_memory": (None, RHO)}
NEVER = 1 << 40  # token index of an empty cache entry: later than every query, so causally masked


@dataclass
class SPSConfig(DecoderConfig):
    arch: str = "sps"
    variant: str = "sps"  # sps | delayed_state | reverse_sps | 2x_memory (see the module docstring)
    sps_window: int = 64  # w: windowed keys are visible to queries at most w tokens later (ignored by 2x_memory)
    predict_id: int = 4  # the tokenizer's reserved <predict> id (data_tools.tokenizer.PREDICT_ID)
    document_mask: bool = True  # (model.eos_id, the decoder's, starts a new document at inference)

    @property
    def persistent(self) -> int | None:
        return VARIANTS[self.variant][0]

    @property
    def readout(self) -> int:
        return VARIANTS[self.variant][1]

    @property
    def w(self) -> int | None:
        """The window in tokens, None when nothing is windowed (2x_memory)."""
        return None if self.persistent is None else self.sps_window

    def validate(self) -> None:
        super().validate()
        if self.variant not in VARIANTS:
            raise ValueError(f"model.variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.sps_window < 0:
            raise ValueError(f"model.sps_window must be >= 0 (0: a windowed slot is seen by its own token only), "
                             f"got {self.sps_window}")
        if self.window:
            raise ValueError(f"model.window={self.window}: SPS windows only one kind of slot, by model.sps_window; "
                             "set model.window=0")
        if not 0 <= self.predict_id < self.vocab_size:
            raise ValueError(f"model.predict_id {self.predict_id} must be a token id below model.vocab_size "
                             f"{self.vocab_size}")
        if self.predict_id == self.eos_id:
            raise ValueError(f"model.predict_id and model.eos_id are both {self.eos_id}; <predict> must be a token "
                             "of its own")

    def validate_run(self, run) -> None:
        """The tokenizer reserves <predict> at model.predict_id (a data check of the trainer, through the
        registry's internal_tokens, refuses datasets that hold it); model.eos_id is its EOS (the decoder's check)."""
        if run.data.task:
            raise ValueError(f"model.arch=sps reads the <predict> id from a tokenizer; data.task={run.data.task} "
                             "has none (train on tokenized files)")
        super().validate_run(run)
        ids = tokenizer_ids(run)
        if ids is None:  # a missing file is the data check's to report
            return
        path = run.data.tokenizer
        if ids["predict"] is None:
            raise ValueError(f"data.tokenizer {path} has no {PREDICT_PIECE} token, which model.arch=sps needs; train "
                             "the tokenizer with `pretrain-data train-tokenizer` (it reserves one) or add it")
        if ids["predict"] != self.predict_id:
            raise ValueError(f"model.predict_id {self.predict_id} is not data.tokenizer's {PREDICT_PIECE} id "
                             f"{ids['predict']}; set model.predict_id={ids['predict']}")
        clash = [name for name in ("unk", "bos", "eos", "pad") if ids[name] == self.predict_id]
        if clash:
            raise ValueError(f"data.tokenizer {path} gives {PREDICT_PIECE} the id of its {clash[0]} token "
                             f"({self.predict_id}); <predict> must be a token of its own")
        if run.parallel.sp and run.data.seq_len % max(run.parallel.tp, 1):
            raise ValueError(f"parallel.sp splits each half of the slots: parallel.tp={run.parallel.tp} must divide "
                             f"data.seq_len={run.data.seq_len}")


class SlotMask(Mask):
    """The SPS mask over slots described by tables: the token index, kind (X or RHO) and document of
    each query slot (`q_*`, indexed by the query's index) and each key slot (`k_*`). q may attend to k
    when k is no later in the interleaved order, in q's document, and persistent or at most w tokens back.
    The dense view is evaluated once per forward and reused by every layer. A key column's visible
    queries are at most two runs, one per half of the de-interleaved slots (the block-sparse kernels'
    form, kernels/attention/runs.py; measured by benchmarks/mask_representations.py)."""
    runs = 2

    def __init__(self, q_tok: Tensor, q_kind: Tensor, k_tok: Tensor, k_kind: Tensor, persistent: int | None,
                 w: int | None, q_doc: Tensor | None = None, k_doc: Tensor | None = None, name: str = "sps",
                 tokens: int | None = None):
        def mask_mod(b, h, q, kv):
            qt, kt = q_tok[q], k_tok[kv]
            ok = 2 * kt + k_kind[kv] <= 2 * qt + q_kind[q]
            if w is not None:
                ok = ok & ((k_kind[kv] == persistent) | (qt - kt <= w))
            if q_doc is not None:
                ok = ok & (q_doc[b, q] == k_doc[b, kv])
            return ok

        super().__init__(mask_mod, name, q_tok.device)
        self._dense: tuple | None = None
        # `tokens`: the tables are slot_tables(tokens) de-interleaved for queries and keys alike, and the
        # documents are [doc_ids | doc_ids] (the training and prefill mask): its runs have a closed form
        self.tokens, self.persistent, self.w, self.doc = tokens, persistent, w, q_doc

    def closed_runs(self, B, Tq, Tk, offset=0, device=None):
        """Key slot (kt, kk) is seen, in the query half of kind c, by the tokens qt with
        kt + (kk > c) <= qt (causal in the interleaved order), qt <= kt + w (a windowed kind), and qt in
        kt's document: one run per half."""
        T = self.tokens
        if T is None or offset or Tq != 2 * T or Tk != 2 * T:
            return None
        j = torch.arange(2 * T, device=self.device)
        kt, kk = (j % T)[None], (j // T)[None]
        if self.doc is None:
            first, end = torch.zeros_like(kt), torch.full_like(kt, T)
        else:
            first, end = document_bounds(self.doc[:, :T])
            first, end = first.repeat(1, 2), end.repeat(1, 2)
        if self.w is not None:
            end = torch.where(kk != self.persistent, torch.minimum(end, kt + self.w + 1), end)
        halves = []
        for c in (X, RHO):
            lo = torch.maximum(kt + (kk > c).long(), first)
            halves.append(torch.stack([c * T + lo, c * T + torch.maximum(end, lo)], -1))
        return torch.stack(halves, -2)

    def dense(self, B, H, Tq, Tk, offset=0, device=None):
        key = (B, Tq, Tk, offset)
        if self._dense is None or self._dense[0] != key:
            self._dense = (key, self.evaluate(B, 1, Tq, Tk, offset, device))
        return self._dense[1]


def slot_tables(T: int, device, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """(token index, kind) of the 2T slots of a T-token sample: de-interleaved [x_1..x_T | ρ_1..ρ_T]
    (the model's layout), or interleaved (x_1, ρ_1, ..., the definition)."""
    s = torch.arange(2 * T, device=device)
    return (s // 2, s % 2) if interleaved else (s % T, s // T)


def _slot_kind(mask: SlotMask):
    """What decides an attention path's speed on an SPS mask (kernels/attention/measured.py): the
    variant's window and whether documents are masked. Only the training and prefill mask (the one with
    closed runs) is measured; a decode step's keeps the static priority."""
    if mask.tokens is None:
        return None
    return ("SlotMask", mask.persistent, mask.w, mask.doc is not None, mask.name)


def _slot_stand_in(kind, B: int, Tq: int, Tk: int, device) -> SlotMask | None:
    _, persistent, w, docs, name = kind
    if Tq != Tk or Tq % 2:
        return None
    T = Tq // 2
    tok, k = slot_tables(T, device)
    doc = attention_measured.doc_ids(B, T, device).repeat(1, 2) if docs else None
    return SlotMask(tok, k, tok, k, persistent, w, doc, doc, name, tokens=T)


attention_measured.register(SlotMask, _slot_kind, _slot_stand_in)


class SPSState:
    """The decode cache: per layer one key/value buffer [B, H_kv, R + P, Dh] holding a ring of the last
    R = w + 1 windowed keys (a windowed key's entry is its token index mod R, written before attending,
    so the entry it replaces, w + 1 tokens back, is outside every window) and then the persistent keys
    (P = max_seq_len per persistent kind). `tok`, `kind`, `doc` describe every entry for the mask (an
    empty entry has token index NEVER). `length` counts the tokens fed (the next position)."""

    def __init__(self, model: "SPS", batch_size: int):
        cfg, p = model.cfg, model.embed.weight
        o = cfg.block_options(1)
        w = cfg.w
        # a window as long as the sequence never binds: both kinds persist (2x Memory's cache)
        self.persistent = None if w is None or w + 1 >= cfg.max_seq_len else cfg.persistent
        self.w = None if self.persistent is None else w
        self.ring = 0 if self.persistent is None else w + 1
        self.max_len = cfg.max_seq_len
        size = self.ring + cfg.max_seq_len * (2 if self.persistent is None else 1)
        shape = (batch_size, o.kv_heads, size, o.head_dim)
        slots = len(model.applications())
        self.k = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(slots)]
        self.v = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(slots)]
        self.tok = torch.full((size,), NEVER, dtype=torch.long, device=p.device)
        self.kind = torch.zeros(size, dtype=torch.long, device=p.device)
        self.doc = torch.zeros(batch_size, size, dtype=torch.long, device=p.device) if cfg.document_mask else None
        self.cur_doc = torch.zeros(batch_size, dtype=torch.long, device=p.device)
        self.stored = 0  # persistent entries written
        self.length = 0
        self._plan: tuple | None = None

    def begin(self, tokens: Tensor, eos_id: int) -> SlotMask:
        """Place the new slots [x.. | ρ..] of tokens [B, n]: their token indices, kinds and documents,
        where each is stored, and the mask of this step."""
        B, n = tokens.shape
        dev = tokens.device
        pos = torch.arange(self.length, self.length + n, device=dev)
        q_tok, q_kind = pos.repeat(2), torch.arange(2, device=dev).repeat_interleave(n)
        q_doc = None
        if self.doc is not None:
            doc, self.cur_doc = continue_doc_ids(tokens, eos_id, self.cur_doc)
            q_doc = doc.repeat(1, 2)
        # where each new slot goes (plain Python: no device sync): persistent slots appended, the last R
        # windowed ones into the ring at their token index mod R
        kinds = [X] * n + [RHO] * n
        src_p = [i for i, k in enumerate(kinds) if self.persistent is None or k == self.persistent]
        src_w = [i for i, k in enumerate(kinds) if self.persistent is not None and k != self.persistent]
        src_w = src_w[-self.ring:] if self.ring else []
        dest = [self.ring + self.stored + j for j in range(len(src_p))]
        dest += [(self.length + i % n) % self.ring for i in src_w]
        src = torch.tensor(src_p + src_w, device=dev)
        dest = torch.tensor(dest, device=dev)
        before = self.ring + self.stored
        self.stored += len(src_p)
        after = self.ring + self.stored
        in_place = n == 1  # both new slots fit their entries now; a chunk's ring keys may evict its own
        if in_place:
            self._write_tables(dest, q_tok[src], q_kind[src], None if q_doc is None else q_doc[:, src])
            k_tok, k_kind = self.tok[:after], self.kind[:after]
            k_doc = None if q_doc is None else self.doc[:, :after]
        else:
            k_tok, k_kind = torch.cat([self.tok[:before], q_tok]), torch.cat([self.kind[:before], q_kind])
            k_doc = None if q_doc is None else torch.cat([self.doc[:, :before], q_doc], 1)
            self._write_tables(dest, q_tok[src], q_kind[src], None if q_doc is None else q_doc[:, src])
        self._plan = (in_place, src, dest, before, after)
        return SlotMask(q_tok, q_kind, k_tok, k_kind, self.persistent, self.w, q_doc, k_doc, "sps_decode")

    def _write_tables(self, dest, tok, kind, doc) -> None:
        self.tok[dest], self.kind[dest] = tok, kind
        if doc is not None:
            self.doc[:, dest] = doc

    def extend(self, slot: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """The keys and values this step's slots attend to (the mask's key tables describe them, offset
        0), storing the new ones k, v [B, H_kv, 2n, Dh] in their entries."""
        in_place, src, dest, before, after = self._plan
        K, V = self.k[slot], self.v[slot]
        if in_place:
            K.index_copy_(2, dest, k.index_select(2, src))
            V.index_copy_(2, dest, v.index_select(2, src))
            return K[:, :, :after], V[:, :, :after], 0
        keys, values = torch.cat([K[:, :, :before], k], 2), torch.cat([V[:, :, :before], v], 2)
        K.index_copy_(2, dest, k.index_select(2, src))
        V.index_copy_(2, dest, v.index_select(2, src))
        return keys, values, 0


class SPS(Decoder):
    """The baseline's blocks over the 2T slots (see the module docstring); the skeleton's embedding,
    head and final norm."""

    def __init__(self, cfg: SPSConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(Block(cfg.block_options(cfg.n_layers)) for _ in range(cfg.n_layers))

    def applications(self) -> list[nn.Module]:
        return list(self.blocks)

    def slots(self, tokens: Tensor) -> Tensor:
        """[B, T] input tokens -> [B, 2T] slots [x_1..x_T | ρ_1..ρ_T]."""
        return torch.cat([tokens, torch.full_like(tokens, self.cfg.predict_id)], 1)

    def slot_mask(self, T: int, doc_ids: Tensor | None, interleaved: bool = False) -> SlotMask:
        """The training mask of T-token samples (doc_ids [B, T] or None) in the given slot layout."""
        tok, kind = slot_tables(T, doc_ids.device if doc_ids is not None else self.rope_device(), interleaved)
        doc = None
        if doc_ids is not None:
            doc = doc_ids.long().repeat_interleave(2, 1) if interleaved else doc_ids.long().repeat(1, 2)
        return SlotMask(tok, kind, tok, kind, self.cfg.persistent, self.cfg.w, doc, doc,
                        f"sps({self.cfg.variant}, w={self.cfg.w})", tokens=None if interleaved else T)

    def readout(self, h: Tensor, T: int) -> Tensor:
        """Final-normed hidden states [B, T, d] of the read-out half of the slots (under sequence
        parallelism h and the result are this rank's slices)."""
        r = self.cfg.readout
        return self.norm(local_sequence(gather_sequence(h)[:, r * T:(r + 1) * T]))

    # The training forward, logits and pipeline stages are the decoder's: the slots and their mask below,
    # then the read-out slots' loss over the batch's loss_mask (no loss where the input is EOS or a target
    # crosses a document or is padding: the data path's loss_mask).
    def inputs(self, tokens: Tensor, positions: Tensor, doc_ids: Tensor | None, cache=None):
        return self.slots(tokens), self.attend(positions.repeat(1, 2), self.slot_mask(tokens.shape[1], doc_ids), cache)

    def new_state(self, batch_size: int) -> SPSState:
        return SPSState(self, batch_size)

    def step(self, tokens: Tensor, state: SPSState) -> tuple[Tensor, SPSState]:
        """Feed tokens [B, n] (each with its <predict> slot) after the cached ones; logits [B, n, V]."""
        B, n = tokens.shape
        if state.length + n > state.max_len:
            raise ValueError(f"generation would exceed model.max_seq_len {state.max_len}")
        positions = torch.arange(state.length, state.length + n, device=tokens.device).repeat(2).expand(B, 2 * n)
        mask = state.begin(tokens, self.cfg.eos_id)
        h = self.body(self.slots(tokens), positions, mask, state)
        state.length += n
        return self.head.logits(self.readout(h, n)), state


def flops_per_token(cfg: SPSConfig, seq_len: int, ctx=None) -> float:
    """Training FLOPs per input token (FLOPS_FORMULA)."""
    d, L = cfg.d_model, cfg.n_layers
    block_params = 2 * d * d + 2 * d * cfg.kv_heads * cfg.head_dim + 3 * d * cfg.ffn
    return 6.0 * (2 * L * block_params + cfg.vocab_size * d) + 12.0 * L * d * 4 * seq_len


FLOPS_FORMULA = ("6 * (2 L (2 d^2 + 2 d d_kv + 3 d f) + V d) + 48 * L * d * T per input token: forward x 3, two slots "
                 "through every block, the head on the read-out slot only, attention over the dense 2T x 2T slot "
                 "grid (each of the 2 slots attends to 2T keys at 12 L d FLOPs each; a block-sparse kernel would skip "
                 "about half) (L layers, width d, key/value width d_kv, FFN width f, vocabulary V, T input tokens)")


def activation_bytes(cfg: SPSConfig, seq_len: int, batch: int, recompute: str = "none") -> int:
    """Peak activation bytes of one micro batch (fp32), as the decoder's (pretrain/models/decoder.py)
    with every block over the 2T slots: in columns of N = batch x seq_len input tokens, a block keeps
    2 (12.25 d + 4.1 f) + 3.8 d (the masked attention path keeps a little more than flash-style
    attention), or its input (2.8 d) under recompute; the embedding of the slots, the read-out and the
    head keep 5.5 d (6.5 d under recompute) and the loss's kept columns (the logits, V: kernels/lm_loss's
    memory_columns); the backward adds the loss's peak (2 V unchunked) or, under recompute, the
    recomputed block's 0.85 of a block when larger. Fitted to tests/test_plan.py's measurements."""
    d, f, V, L = cfg.d_model, cfg.ffn, cfg.vocab_size, cfg.n_layers
    block = 2 * (12.25 * d + 4.1 * f) + 3.8 * d
    loss_kept, loss_peak = memory_columns(V, d, batch * seq_len, cfg.loss_chunk)
    if recompute == "none":
        columns = loss_kept + 5.5 * d + L * block + loss_peak
    else:
        columns = loss_kept + 6.5 * d + L * 2.8 * d + max(loss_peak, 0.85 * block)
    return int(4 * batch * seq_len * columns)


def internal_tokens(cfg: SPSConfig) -> dict[str, int]:
    return {"<predict>": cfg.predict_id}


SPEC = register(ArchSpec(
    name="sps",
    config_cls=SPSConfig,
    build=SPS,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    hf=RemoteAdapter("sps"),  # --format hf: remote code generated from this file (pretrain/hf_remote)
    supports=Support(pp=True),
    pipeline_split=decoder.pipeline_split,
    activation_bytes=activation_bytes,
    recompute_units=unit_modules,  # each block
    internal_tokens=internal_tokens,
))
