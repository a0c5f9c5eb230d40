"""The Context-Ready Transformer (CRT; spec-000, arXiv:2606.27538): a pre-norm RoPE decoder of D
layers with a correction FFN in front of it, fed the previous position's block output.

Streaming (the model's definition, spec §2.2; 0-indexed, z_{-1} = 0):

    c_t = corr(z_{t-1}, e_t)            e.g. corr_ffn(LN_c(z_{t-1} + e_t)) for the `add` variant
    z_t = Blocks(e_t + c_t)             non-cumulative: always the embedding plus the new correction
    logits_t = head(LN_f(z_t))

so decoding carries the KV caches plus one vector z_prev per sequence. Training (§2.3) runs K passes
over the whole sequence with shared weights: pass k feeds e + c^(k-1), where c^(k-1) is computed from
pass k-1's outputs shifted right by one (c^(0) = 0); the loss is on the last pass and gradients flow
through every pass. K ~ U{k_min..k_max} per step, drawn from the step context. The first K-1 positions
of the last pass equal streaming exactly, and K >= T+1 reproduces it everywhere (§2.3's off-by-one:
Lemma 1 counts corrections, not outputs). `train_mode: bptt` trains the streaming recurrence itself,
step by step (§2.4).

`correction: none` is the paper's roformer baseline (K = 1), `pre_ffn` its hFFN variant. The block is
a config field: `paper` (§2.1: LayerNorm with bias, GELU FFN of 4C with biases, untied head) or
`llama` (the baseline's block), so a trained baseline converts into a CRT (§2.6: fc2 zero).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from kernels.attention import decoder_mask
from kernels.lm_loss import memory_columns
from parallel.layers import gather_sequence, shift_right
from pretrain.models.base import EVAL
from pretrain.models.blocks import Attend, Block, BlockOptions, dropout, make_norm, mlp, upgrade_attention_state
from pretrain.models.decoder import Decoder, DecoderConfig, GradCache, KVCache
from pretrain.hf_remote.adapter import RemoteAdapter
from pretrain.models.registry import ArchSpec, DecodeRelation, Support, register
from pretrain.models.units import Whole

BLOCKS = ("paper", "llama")
CORRECTIONS = ("add", "blind", "concat", "block_head", "none")


@dataclass
class CRTConfig(DecoderConfig):
    arch: str = "crt"
    block: str = "paper"  # paper (spec §2.1, GPT-2 style) | llama (the baseline's block, for conversion)
    n_layers: int = 1  # D
    ffn_hidden: int = 0  # 0: 4 * d_model for the paper block, 3 * d_model for the llama block
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the paper's parameter counts are untied
    correction: str = "add"  # add | blind | concat | block_head | none (the roformer baseline, K = 1)
    pre_ffn: bool = False  # one pre-norm residual FFN on the embeddings (the roformer-hFFN baseline)
    k_max: int = 5  # passes per training step: K ~ U{k_min..k_max}
    k_min: int = 2  # 0: K is always k_max
    # passes at evaluation and for `logits`: 0 = k_max (exact under train_mode=bptt); -1 = exact at
    # every position (the recurrence token by token, equal to T + 1 passes)
    eval_k: int = 0
    train_mode: str = "unrolled"  # unrolled (K parallel passes) | bptt (the exact recurrence, step by step)
    bptt_memory_gb: float = 16.0  # refuse BPTT runs whose kept activations would exceed this per rank
    prefill_chunk: int = 8  # decode: prompt tokens run in parallel at once (exactly: one pass per token)
    # of attention probabilities and after attention, FFN, correction and pre-FFN outputs (spec §7.7),
    # a fresh mask in every pass; none on the embedding, which every pass reuses
    dropout: float = 0.0
    corr_out_init: str = "normal"  # the correction's output layer: normal (N(0, std / sqrt(2D))) | zero

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or (4 if self.block == "paper" else 3) * self.d_model

    def block_options(self, depth: int) -> BlockOptions:
        """The llama block is the baseline's; the paper block (spec §2.1) is GPT-2's: LayerNorm, a GELU
        MLP, biases, dropout, both output layers' init scaled by depth."""
        llama = super().block_options(depth)
        if self.block == "llama":
            return llama
        return replace(llama, norm="layer", mlp="gelu", bias=True, dropout=self.dropout, scale_ffn_out=True)

    @property
    def corrected(self) -> bool:
        return self.correction != "none"

    def validate(self) -> None:
        super().validate()
        for name, value, allowed in (("block", self.block, BLOCKS), ("correction", self.correction, CORRECTIONS),
                                     ("train_mode", self.train_mode, ("unrolled", "bptt")),
                                     ("corr_out_init", self.corr_out_init, ("normal", "zero"))):
            if value not in allowed:
                raise ValueError(f"model.{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.k_max < 1:
            raise ValueError(f"model.k_max must be >= 1 (K counts block passes), got {self.k_max}")
        if self.k_min and not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"model.k_min {self.k_min} must lie in 1..model.k_max ({self.k_max}), or be 0 for "
                             "a fixed K")
        if self.eval_k < -1:
            raise ValueError(f"model.eval_k must be >= 1, 0 (k_max) or -1 (T + 1), got {self.eval_k}")
        if not self.corrected and (self.k_max != 1 or self.k_min not in (0, 1) or self.eval_k > 1):
            raise ValueError("model.correction=none is the roformer: it runs one pass, so model.k_max must be 1 "
                             f"(got k_max={self.k_max}, k_min={self.k_min}, eval_k={self.eval_k})")
        if self.dropout and self.block == "llama":
            raise ValueError("model.dropout is placed by the paper block; the llama block (the baseline's) has "
                             "none, so use model.dropout=0 with model.block=llama")
        if not 0 <= self.dropout < 1 or self.prefill_chunk < 1 or self.bptt_memory_gb <= 0:
            raise ValueError("model.dropout must be in [0, 1), model.prefill_chunk >= 1 and "
                             "model.bptt_memory_gb > 0")

    @property
    def exact_eval(self) -> bool:
        """Evaluation by the recurrence itself (eval_k=-1, or the default under BPTT)."""
        return self.corrected and (self.eval_k == -1 or (self.eval_k == 0 and self.train_mode == "bptt"))

    def validate_run(self, run) -> None:
        p, T, B = run.parallel, run.data.seq_len, run.train.micro_batch_seqs
        if self.exact_eval and (p.sp or self.document_mask):
            raise ValueError("model.eval_k=-1 evaluates by the recurrence, one token at a time from each sample's "
                             f"start, which {'parallel.sp' if p.sp else 'model.document_mask'}=true does not allow; "
                             f"set model.eval_k to T + 1 = {T + 1} passes for the same values")
        if self.train_mode != "bptt":
            return
        if self.dropout:
            raise ValueError("model.train_mode=bptt runs without dropout (its step-by-step attention has none); "
                             "set model.dropout=0")
        if self.document_mask:
            raise ValueError("model.train_mode=bptt streams each sample from its first token: it does not "
                             "support model.document_mask=true")
        if p.recompute != "none":
            raise ValueError(f"parallel.recompute={p.recompute} cannot recompute BPTT's step-by-step cache; use "
                             "parallel.recompute=none with model.train_mode=bptt")
        if p.sp:
            raise ValueError("parallel.sp=true splits the sequence, which BPTT feeds one token at a time")
        # Autograd keeps, per step and layer, the keys and values attended to (kv_heads of them: SDPA
        # keeps GQA's k and v unexpanded; the reference path would expand them) and the probabilities.
        keys = min(T, self.window or T)
        need = B * self.n_layers * T * keys * (2 * self.kv_heads * self.head_dim + self.n_heads) * 4 / max(p.tp, 1)
        if need > self.bptt_memory_gb * 2**30:
            raise ValueError(f"model.train_mode=bptt at data.seq_len={T} and train.micro_batch_seqs={B} would keep "
                             f"about {need / 2**30:.1f} GB of activations per rank, over model.bptt_memory_gb="
                             f"{self.bptt_memory_gb:g}; shorten the sequence, the micro batch or the window")


class Trunk(nn.Module):
    """The D blocks: one pass. A module of its own so that one pass can be recomputed as a unit."""

    def __init__(self, cfg: CRTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg.block_options(cfg.n_layers)) for _ in range(cfg.n_layers))

    def forward(self, x: Tensor, a: Attend) -> Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, a.at(i))
        return x


class Correction(nn.Module):
    """c_t from the previous position's block output z_{t-1} (and input x_{t-1}) and the embedding e_t:
    add: corr(LN(z + e)); blind: corr(LN(z)); concat: corr(LN([z; e])) with a 2C-wide first layer;
    block_head: z - x, the block's own residual update at t-1 (no parameters; spec §2.5)."""

    def __init__(self, cfg: CRTConfig):
        super().__init__()
        self.variant = cfg.correction
        o = cfg.block_options(cfg.n_layers)  # the block family's norm and MLP, its output init at depth D
        if self.variant != "block_head":
            width = 2 * cfg.d_model if self.variant == "concat" else cfg.d_model
            self.norm = make_norm(o.norm, width, o.norm_eps)
            self.ffn = mlp(o, d_in=width, out_std=0.0 if cfg.corr_out_init == "zero" else o.out_std)
            self.drop = dropout(o.dropout)

    def forward(self, z_prev: Tensor, x_prev: Tensor | None, e: Tensor) -> Tensor:
        if self.variant == "block_head":
            return z_prev - x_prev
        u = {"add": lambda: z_prev + e, "blind": lambda: z_prev,
             "concat": lambda: torch.cat((z_prev, e), dim=-1)}[self.variant]()
        return self.drop(self.ffn(self.norm(u)))


class CRTState(KVCache):
    """Decode state: the per-layer KV caches, the previous position's block output z_prev and input
    x_prev [B, 1, C] (zero before the first token)."""

    z_prev: Tensor
    x_prev: Tensor


class CRT(Whole, Decoder):
    """One pipeline unit (units.Whole): each of the K passes runs every block."""

    def __init__(self, cfg: CRTConfig):
        super().__init__(cfg)
        self.trunk = Trunk(cfg)
        self.correction = Correction(cfg) if cfg.corrected else None
        if cfg.pre_ffn:  # roformer-hFFN: e <- e + FFN(LN(e)), once, before the stack
            o = cfg.block_options(cfg.n_layers)
            self.pre_norm = self.make_norm(cfg.d_model)
            self.pre = mlp(o, out_std=o.out_std)
            self.pre_drop = dropout(o.dropout)

    def applications(self) -> list[nn.Module]:
        return list(self.trunk.blocks)  # one pass per token at decode: one cache slot per layer

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        e = self.embed(tokens)
        return e + self.pre_drop(self.pre(self.pre_norm(e))) if self.cfg.pre_ffn else e

    def compile(self, *args, **kwargs) -> None:
        """torch.compile one pass (the trunk and the correction), not the K-pass forward: the K loop
        stays in Python, so every K drawn shares the same graphs instead of compiling one forward per K.
        Under BPTT nothing is compiled: its cache grows by a token every step."""
        if self.cfg.train_mode == "bptt":
            return
        for module in (self.trunk, self.correction):
            if module is not None:
                module.compile(*args, **kwargs)

    def compile_blocks(self, **kwargs) -> None:
        """train.compile_scope=blocks: `compile` already compiles a piece (one pass), not the K-pass forward."""
        self.compile(**kwargs)

    # -- training and evaluation: K passes in parallel ----------------------------------------------
    def passes(self, tokens, positions, doc_ids, K: int, corrections: int = 0) -> tuple[Tensor, list[Tensor]]:
        """Block output z^(K) [B, T, C] after K passes, and the last `corrections` corrections
        c^(K-corrections+1) .. c^(K) (c^(K) is computed only when asked: the loss does not use it)."""
        a = self.attend(positions, self.mask(doc_ids))
        reset = doc_ids[:, 1:] != doc_ids[:, :-1] if doc_ids is not None else None
        if reset is not None:  # z_{-1} = 0 at each document's start, as at the sample's
            reset = F.pad(reset, (1, 0), value=True)
        e = self.embed_tokens(tokens)
        x, kept = e, []
        for k in range(1, K + 1):
            z = self.trunk(x, a)
            if self.correction is not None and (k < K or corrections):
                x_prev = shift_right(x, reset) if self.correction.variant == "block_head" else None
                c = self.correction(shift_right(z, reset), x_prev, e)
                kept = (kept + [c])[-corrections:] if corrections else kept
                x = e + c  # non-cumulative: the embedding plus the newest correction
        if K == 1 and self.correction is not None and torch.is_grad_enabled():
            # A step with no correction still gives its parameters a (zero) gradient, so data-parallel
            # engines that wait for every gradient (DDP, megatron, ZeRO) see the same set each step.
            z = z + 0.0 * self.correction(z[:, :1], z[:, :1], e[:, :1])
        return z, kept

    def forward(self, batch, ctx=EVAL) -> tuple[Tensor, dict]:
        z, diagnostics = self.block_outputs(batch, ctx)
        return self.head.loss(self.norm(z), batch.labels, batch.loss_mask), diagnostics

    def block_outputs(self, batch, ctx) -> tuple[Tensor, dict]:
        """The last pass's block outputs [B, T, C] and the diagnostics: by the recurrence (BPTT
        training, exact evaluation) or by K parallel passes (K logged in training, L̂ in evaluation)."""
        doc_ids = batch.doc_ids if self.cfg.document_mask else None
        if ctx.training and self.cfg.train_mode == "bptt":
            return self.recurrence(batch.tokens, batch.positions), {}
        K = num_passes(self.cfg, ctx, batch.tokens.shape[1])
        if self.exact_by_recurrence(doc_ids):
            return self.recurrence(batch.tokens, batch.positions), {}
        if ctx.training or K < 2 or self.correction is None:
            z, _ = self.passes(batch.tokens, batch.positions, doc_ids, K)
            trained_k = ctx.training and self.correction is not None
            return z, ({"k": torch.tensor(float(K), device=z.device)} if trained_k else {})
        z, c = self.passes(batch.tokens, batch.positions, doc_ids, K, corrections=3)
        return z, contraction(c, K, batch.doc_ids)

    def logits(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        K = num_passes(self.cfg, EVAL, tokens.shape[1])
        doc_ids = self.inference_doc_ids(tokens)
        z = self.recurrence(tokens, positions) if self.exact_by_recurrence(doc_ids) else \
            self.passes(tokens, positions, doc_ids, K)[0]
        return self.head.logits(self.norm(z))

    def exact_by_recurrence(self, doc_ids=None) -> bool:
        """Whether the exact evaluation asked for by eval_k=-1 runs as the recurrence itself: the
        values of T+1 parallel passes (spec §2.4) at the cost of one pass, token by token. Not with
        document masks (the recurrence streams one document) nor under autograd."""
        return self.cfg.exact_eval and doc_ids is None and not torch.is_grad_enabled()

    # -- the recurrence itself: BPTT training and streaming decode -----------------------------------
    # T single-token steps would unroll into one huge graph: they run eager. torch._disable_dynamo is
    # torch.compiler.disable imported at the first call: the decorator would import dynamo with this
    # module, about 1 s of CPU at every process start, whatever architecture it runs
    @torch._disable_dynamo
    def recurrence(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Block outputs [B, T, C] computed token by token, differentiably (BPTT: exact gradients of
        the streaming model, spec §2.4); everything that does not depend on the state is hoisted."""
        B, T = tokens.shape
        cos, sin = self.rope.at(positions)
        mask = decoder_mask(None, self.cfg.window or None)
        e = self.embed_tokens(tokens)
        cache = GradCache(self.cfg.n_layers, self.cfg.window)
        z_prev = x_prev = e.new_zeros(B, 1, e.shape[-1])
        outputs = []
        for t in range(T):
            e_t = e[:, t:t + 1]
            x_prev = e_t + self.correction(z_prev, x_prev, e_t) if self.correction is not None else e_t
            z_prev = self.trunk(x_prev, Attend(mask, (cos[:, :, t:t + 1], sin[:, :, t:t + 1]), cache))
            outputs.append(z_prev)
        return torch.cat(outputs, dim=1)

    def new_state(self, batch_size: int) -> CRTState:
        p, cfg = self.embed.weight, self.cfg
        state = CRTState(cfg.n_layers, batch_size, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim, p.device, p.dtype)
        state.z_prev = state.x_prev = torch.zeros(batch_size, 1, cfg.d_model, device=p.device, dtype=p.dtype)
        return state

    def step(self, tokens: Tensor, state: CRTState) -> tuple[Tensor, CRTState]:
        """Feed tokens [B, n] after the cached ones, exactly, in chunks of model.prefill_chunk."""
        n = tokens.shape[1]
        if state.length + n > state.max_len:
            raise ValueError(f"generation would exceed model.max_seq_len {state.max_len}")
        chunk = self.cfg.prefill_chunk
        out = [self._chunk(tokens[:, i:i + chunk], state) for i in range(0, n, chunk)]
        return torch.cat(out, dim=1), state

    def _chunk(self, tokens: Tensor, state: CRTState) -> Tensor:
        """S tokens in parallel on top of exact caches, exactly (spec §2.2's chunked prefill). The
        first correction uses the cached z_prev, so c^(0) is exact at the chunk's first position and
        pass k makes outputs exact up to position k-1: S passes suffice (one for a single token)."""
        S, L = tokens.shape[1], state.length
        positions = torch.arange(L, L + S, device=tokens.device).expand_as(tokens)
        doc_ids = state.documents(tokens, self.cfg.eos_id) if self.cfg.document_mask else None
        a = self.attend(positions, self.mask(doc_ids), state)
        # z_{-1} = 0 at each document's start (model.document_mask), as in training
        starts = None if doc_ids is None else (doc_ids != F.pad(doc_ids, (1, -1), value=0))[:, L:, None]
        e = self.embed_tokens(tokens)
        z, x = e.new_zeros(e.shape), e.new_zeros(e.shape)  # pass 0's outputs: unknown, so zero

        def previous(last: Tensor, now: Tensor) -> Tensor:  # each position's predecessor in the stream
            prev = torch.cat((last, now[:, :-1]), dim=1)
            return prev if starts is None else prev.masked_fill(starts, 0.0)

        for _ in range(S if self.correction is not None else 1):
            if self.correction is not None:
                z_prev = previous(state.z_prev, z)
                x_prev = None  # only block_head reads the previous input
                if self.correction.variant == "block_head":
                    x_prev = previous(state.x_prev, x)
                x = e + self.correction(z_prev, x_prev, e)
            else:
                x = e
            z = self.trunk(x, a)  # (re)writes this chunk's keys and values
        state.length += S
        state.z_prev, state.x_prev = z[:, -1:], x[:, -1:]
        return self.head.logits(self.norm(z))


@torch._disable_dynamo  # a host-side draw: not traced by torch.compile (lazily, as `recurrence`)
def num_passes(cfg: CRTConfig, ctx, seq_len: int) -> int:
    """K for a step: U{k_min..k_max} from the step's generator in training (every rank and a resumed
    run draw the same), model.eval_k (0: k_max, -1: T + 1) otherwise; 1 for the roformer."""
    if not cfg.corrected:
        return 1
    if not ctx.training:  # more than T + 1 passes change nothing (spec §2.4): capped there
        return seq_len + 1 if cfg.exact_eval else min(cfg.eval_k or cfg.k_max, seq_len + 1)
    if not cfg.k_min or cfg.k_min == cfg.k_max:
        return cfg.k_max
    return int(torch.randint(cfg.k_min, cfg.k_max + 1, (), generator=ctx.generator(), device="cpu"))  # cpu: a meta dry run draws too


def inference_settings(cfg: CRTConfig, seq_len: int) -> list[str]:
    """The K an evaluation at length T runs, and why (`pretrain eval` prints it)."""
    if not cfg.corrected:
        return ["K = 1 pass (no correction: the roformer)"]
    if cfg.exact_eval:
        return [f"K = T + 1 = {seq_len + 1} passes, computed by the recurrence (model.eval_k=-1)"]
    asked = cfg.eval_k or cfg.k_max
    if asked > seq_len + 1:
        return [f"K = T + 1 = {seq_len + 1} passes: model.eval_k={asked} is capped there (more passes than T + 1 "
                "change nothing)"]
    return [f"K = {asked} passes (model.eval_k={cfg.eval_k}{', i.e. k_max' if not cfg.eval_k else ''}; T + 1 = "
            f"{seq_len + 1} gives the recurrence's values)"]


def contraction(c: list[Tensor], K: int, doc_ids: Tensor | None = None) -> dict[str, Tensor]:
    """The empirical contraction L̂_t = |c^K_t - c^(K-1)_t| / |c^(K-1)_t - c^(K-2)_t| (spec §2.7), over
    the positions t >= K-1 of each document only (before that both are exactly 0/0 or 0/x), taken
    over the whole sequence under sequence parallelism: per sequence its max over t (`lhat_max`) and
    its median (`lhat_median`), each averaged over the batch (c^0 = 0 when K = 2)."""
    c_prev2, c_prev, c_last = (gather_sequence(x) for x in ([torch.zeros_like(c[0])] + c)[-3:])
    T = c_last.shape[1]
    index = torch.arange(T, device=c_last.device).expand(c_last.shape[0], T)
    if doc_ids is not None:  # the index within the document: t minus the document's first position
        starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)
        index = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    valid = index >= K - 1
    ratio = (c_last - c_prev).norm(dim=-1) / ((c_prev - c_prev2).norm(dim=-1) + 1e-12)
    ratio = ratio.masked_fill(~valid, float("nan"))
    # sequences without a valid position are left out (an all-short batch logs NaN)
    return {"lhat_max": ratio.nan_to_num(nan=-1.0).amax(dim=1).masked_fill(~valid.any(1), float("nan")).nanmean(),
            "lhat_median": ratio.nanmedian(dim=1).values.nanmean()}


def block_params(cfg: CRTConfig) -> int:
    """Matmul weights of one block: attention 2C^2 + 2C C_kv (q and output, k and v; 4C^2 without
    GQA), FFN 2CF (GELU) or 3CF (SwiGLU)."""
    C = cfg.d_model
    return 2 * C * C + 2 * C * cfg.kv_heads * cfg.head_dim + (2 if cfg.block == "paper" else 3) * C * cfg.ffn


def corr_params(cfg: CRTConfig) -> int:
    if not cfg.corrected or cfg.correction == "block_head":
        return 0
    width = (2 if cfg.correction == "concat" else 1) * cfg.d_model
    return (width + cfg.d_model) * cfg.ffn if cfg.block == "paper" else (2 * width + cfg.d_model) * cfg.ffn


def flops_per_token(cfg: CRTConfig, seq_len: int, ctx=None) -> float:
    """FLOPS_FORMULA for the step `ctx` (its K), or its expectation over K when ctx is None."""
    if cfg.train_mode == "bptt" and (ctx is None or ctx.training):
        Ks = [1]
    elif ctx is None:
        Ks = range(cfg.k_min or cfg.k_max, cfg.k_max + 1) if cfg.corrected else [1]
    else:
        Ks = [num_passes(cfg, ctx, seq_len)]
    C, D, keys = cfg.d_model, cfg.n_layers, min(seq_len, cfg.window or seq_len)
    pre = corr_params(CRTConfig(**{**cfg.__dict__, "correction": "add"})) if cfg.pre_ffn else 0
    total = 0.0
    for K in Ks:
        corr_uses = 1 if cfg.train_mode == "bptt" else K - 1
        total += 6.0 * (K * D * block_params(cfg) + corr_uses * corr_params(cfg) + pre + cfg.vocab_size * C)
        total += 12.0 * K * D * C * keys
    return total / len(Ks)


FLOPS_FORMULA = ("6 * (K * D * P_block + (K - 1) * P_corr + P_pre + V C) + 12 * K * D * C * T_k: K passes of D "
                 "blocks (P_block = 2 C^2 + 2 C C_kv + 2 C F, or 3 C F for the llama block; C_kv = n_kv_heads * "
                 "head_dim, C without GQA), K - 1 corrections (P_corr = "
                 "2 C F, or 3 C F; a 2C-wide first layer for concat), the pre-FFN of roformer-hFFN, the head; "
                 "attention at T_k = min(T, window) keys; forward x 3, 2 FLOPs per multiply-add; K is the "
                 "step's draw (its mean U{k_min..k_max} for the expected value), 1 with one correction per "
                 "token under BPTT")


def paper_formula_params(cfg: CRTConfig) -> int:
    """spec §3.1's count: matmul weights and the head (D 12C^2 + 8C^2 + 2VC untied), no biases or norms."""
    head = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    pre = corr_params(CRTConfig(**{**cfg.__dict__, "correction": "add"})) if cfg.pre_ffn else 0
    return cfg.n_layers * block_params(cfg) + corr_params(cfg) + pre + head


def convert(source_arch: str, source_cfg, source_state: dict[str, Tensor], target_cfg: CRTConfig) -> dict[str, Tensor]:
    """A trained transformer as a CRT (spec §2.6): its embedding, blocks, final norm and head copied;
    the correction's norm at one (and zero bias), its first layer at a fresh init and its output layer
    zero, so the correction is identically zero and the CRT computes the transformer's function for
    every K and in streaming until fine-tuning moves the output layer. Sources: a `baseline` run (into
    the llama block) or a CRT-family run of the same block (a roformer, correction none)."""
    if source_arch == "baseline":
        block = "llama"
    elif source_arch == "crt":
        block = source_cfg.block
    else:
        raise ValueError(f"model.arch crt converts from a baseline or crt run, not from {source_arch!r}")
    if target_cfg.correction in ("none", "block_head"):
        raise ValueError(f"converting into model.correction={target_cfg.correction} would not start from the "
                         "source's function (only a correction FFN with a zero output layer does); use add, blind "
                         "or concat")
    fields = ("block", "d_model", "n_layers", "n_heads", "kv_heads", "ffn", "vocab_size", "tie_embeddings",
              "norm_eps", "rope_theta", "window", "pre_ffn")
    source = dict(zip(fields, [block] + [getattr(source_cfg, f, False) for f in fields[1:]]))
    for name, value in source.items():
        if getattr(target_cfg, name) != value:
            field = "n_kv_heads" if name == "kv_heads" else name  # compared effective (0 = n_heads), named by its field
            raise ValueError(f"cannot convert a {source_arch} run with model.{field}={value} into a CRT with "
                             f"model.{field}={getattr(target_cfg, field)}: set it to {value}")
    device = next(iter(source_state.values())).device
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)  # the correction's first layer: a fresh init, the same on every rank
        state = CRT(target_cfg).state_dict()
    for name, tensor in source_state.items():
        target = name if source_arch == "crt" or not name.startswith("blocks.") else "trunk." + name
        if target.startswith(("trunk.", "embed.", "norm.", "head.", "pre")) and target in state:
            state[target] = tensor
    for name in state:
        if name.startswith("correction.ffn.") and name.split(".")[2] in ("fc2", "down"):
            state[name] = torch.zeros_like(state[name])
    return state


def _pass_units(model: CRT) -> list[nn.Module]:
    return [model.trunk] + ([model.correction] if model.correction is not None else [])


def _block_units(model: CRT) -> list[nn.Module]:
    return list(model.trunk.blocks) + ([model.correction] if model.correction is not None else [])


def activation_bytes(cfg: CRTConfig, seq_len: int, batch: int, recompute: str = "none") -> int:
    """Peak activation bytes of one micro batch (fp32) at K = k_max passes (the most a step draws), in
    columns of N = batch x seq_len, fitted to tests/test_plan.py's measurements of the paper block
    (f = 4 d; V = 4096): each block application of each pass keeps 10.25 d + 2 f and each pass's correction
    9.6 d, the rest 0.82 of the loss's kept columns (the logits, V, unchunked: kernels/lm_loss's
    memory_columns), the loss's backward its peak (2 V unchunked). Policy pass (= full) keeps each pass's
    state (2 d) and recomputes a pass in the backward (at most 3/4 of its activations at once, as
    measured); block keeps each block input (1.2 d per application) and 3 d per pass; both keep 3.3 d
    outside the passes, and what the loss kept until its backward, which comes before the recomputation.
    Parameter gradients are left out."""
    d, f, V, L, K = cfg.d_model, cfg.ffn, cfg.vocab_size, cfg.n_layers, cfg.k_max
    application, correction = 10.25 * d + 2 * f, 9.6 * d
    kept, peak = memory_columns(V, d, batch * seq_len, cfg.loss_chunk)  # the loss's: V and 2 V unchunked
    if recompute == "none":
        columns = 0.82 * kept + K * (L * application + correction) + peak
    elif recompute == "block":
        columns = 3.3 * d + K * (3 * d + L * 1.2 * d) + max(kept + peak, application)  # the loss's backward first
    else:
        # the recomputed pass in the backward: below the loss's 2 V in every measured case; bounded so
        columns = 3.3 * d + K * 2 * d + max(kept + peak, 0.75 * (L * application + correction))
    return int(4 * batch * seq_len * columns)


SPEC = register(ArchSpec(
    name="crt",
    config_cls=CRTConfig,
    build=CRT,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    formula_params=paper_formula_params,
    # eval_k=64: the parallel form with K >= T+1 passes for the registry test's shorter sequences
    inference_settings=inference_settings,
    decode=DecodeRelation("exact", config={"eval_k": 64}, why=(
        "streaming computes the recurrence's fixed point, which the K-pass parallel forward reaches at every "
        "position when K >= T + 1 (spec §2.3); at the trained K only the first K - 1 positions are exact")),
    progress=("k",),
    hf=RemoteAdapter("crt"),  # --format hf: remote code generated from this file (pretrain/hf_remote)
    supports=Support(reasons={"pp": (
        "each of the K passes runs every block and feeds the last stage's output back to the first, so "
        "pipeline stages would idle K - 1 times out of K")}),
    activation_bytes=activation_bytes,
    convert=convert,
    convert_fields=lambda source_arch, source_cfg: {"block": "llama"} if source_arch == "baseline" else {},
    upgrade_state=upgrade_attention_state,  # the shared attention's (trunk.blocks.*.attn.qkv before GQA)
    # pass: keep only each pass's input and recompute the pass (memory ~K B T C plus one pass);
    # block: keep each block's input in each pass (K D B T C plus one block)
    recompute_units={"pass": _pass_units, "block": _block_units},
))
