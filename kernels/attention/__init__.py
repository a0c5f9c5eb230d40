"""Attention: the one entry point every model calls, dispatched over registered paths.

    attention(q, k, v, mask, offset=0, scale=None, dropout_p=0.0, alibi_slopes=None)

q [B, H, Tq, Dh] at absolute positions offset .. offset+Tq-1 (offset > 0 in streaming decode, after
that many cached tokens); k, v [B, H_kv, Tk, Dh] at 0 .. Tk-1, where H_kv may divide H (grouped-query
attention: query head h reads key/value head h // (H / H_kv), as in Llama; a head count that does not
divide is a ValueError). `mask` is a value of kernels.attention.masks (causal(), document(doc_ids),
window(w), prefix(n), their & and |, or an architecture's own predicate); the same value serves
training, prefill and decode. A caller whose cache keeps only the last keys (a sliding window) passes
the offset into that trimmed cache: causal and window masks depend only on relative positions.
`alibi_slopes` [H] adds ALiBi's -slope_h * |i - j| to the scores.

Paths (kernels/registry.py), picked per call by priority among those whose capability check accepts
the call (devices, dtypes, shapes, whether autograd needs a backward: Python values, never tensor data):
    "flash_attn" the flash-attn package's varlen kernel (flash_varlen.py), when installed: CUDA, bf16/fp16,
                 causal masks with packed documents (cu_seqlens from the ids) and sliding windows
    "triton"     block-sparse flash attention from the mask's column runs (triton_path.py,
                 triton_kernels.py): CUDA, every mask that declares its runs (the fastest there, measured);
                 on a CPU only forced, under TRITON_INTERPRET=1 (the tests)
    "flex"       FlexAttention, compiled (flex.py): CUDA for training and prefill of the other masks; CPU
                 for forwards that need no backward, from flex.FLEX_MIN_KEYS keys on (evaluation, prefill)
    "sdpa"       torch's scaled_dot_product_attention with the dense mask (sdpa.py): every device and
                 every call (ALiBi, dropout), and plain causal attention, where its own causal kernels
                 need no mask and are the fastest
    "reference"  the naive definition (reference.py): only when forced
On CUDA, where more than one path can serve a call, the priority is only the order of candidates: the
first call of each mask kind and shape measures their forward + backward on stand-in inputs and keeps
the fastest (kernels/attention/measured.py; PRETRAIN_KERNELS_MEASURE=0 turns it off). The block-sparse
paths skip plain causal masks (SDPA's causal kernels win there) unless forced. Force
one with PRETRAIN_KERNELS=attention=<path> (or the older PRETRAIN_ATTENTION=<path>), or use_path(name)
in code; paths_used() names the paths that ran since reset_paths_used().
"""
from __future__ import annotations

from torch import Tensor

from kernels import registry
from kernels.attention import flash_varlen, flex, masks, measured, reference, sdpa, triton_path
from kernels.attention.masks import Mask, causal, decoder_mask, document, full, is_causal, prefix, window
from kernels.attention.reference import document_causal_mask

OP = registry.op("attention", legacy_env="PRETRAIN_ATTENTION")


def _block_sparse(refusal, name):
    """A block-sparse path's refusal: its own (told whether the path is forced), and plain causal
    attention unless forced (SDPA's causal kernels win there)."""
    def check(q, k, v, mask, offset=0, *rest, **kw):  # its own check first: it refuses most calls cheaply
        forced = OP.forced == name
        why = refusal(q, k, v, mask, offset, *rest, forced=forced, **kw)
        if why is None and not forced and is_causal(mask, q.shape[-2], k.shape[-2], offset):
            return "plain causal attention goes to SDPA unless this path is forced"
        return why
    return check


OP.register("flash_attn", flash_varlen.attention, priority=40,
            refusal=_block_sparse(flash_varlen.refusal, "flash_attn"))
OP.register("triton", triton_path.attention, priority=30, refusal=_block_sparse(triton_path.refusal, "triton"))
OP.register("flex", flex.attention, priority=20, refusal=_block_sparse(flex.refusal, "flex"))
OP.register("sdpa", sdpa.attention, priority=10)
OP.register("reference", reference.attention, auto=False)
# on CUDA the first call of each mask kind and shape times its capable paths' forward + backward and
# keeps the fastest (kernels/registry.py, measured.py); CPU calls keep the priorities above
OP.measure_with(registry.Measured(measured.key, measured.inputs, describe=measured.describe))
PATHS = tuple(OP.paths)
GENERAL_PATHS = ("sdpa", "reference")  # the paths that serve every call on every device (float64, ALiBi, backward on CPU)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None) -> Tensor:
    """softmax(q k^T * scale [+ ALiBi], masked by `mask`) v -> [B, H, Tq, Dh]; scale defaults to
    1/sqrt(Dh); dropout_p drops attention probabilities (pass 0 outside training)."""
    return OP(q, k, v, mask, offset, scale, dropout_p, alibi_slopes)


def use_path(name: str | None) -> None:
    """Force every later call onto path `name`; None returns to picking by capability."""
    OP.force(name, "use_path")


def paths_used() -> frozenset[str]:
    """Names of the attention paths that have run since the last reset_paths_used()."""
    return frozenset(registry.paths_used().get("attention", ()))


def reset_paths_used() -> None:
    registry.reset_paths_used()


__all__ = ["GENERAL_PATHS", "Mask", "PATHS", "attention", "causal", "decoder_mask", "document", "document_causal_mask", "full",
           "masks", "paths_used", "prefix", "reset_paths_used", "use_path", "window"]
