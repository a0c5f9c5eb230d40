"""The "flex" attention path: torch's FlexAttention, compiled, from the same mask values.

The mask's predicate is FlexAttention's mask_mod already (kernels/attention/masks.py), shifted by the
decode offset. The block mask is built from the mask's column runs when it declares them
(kernels/attention/runs.py: O(Tk) for the built-ins, and the same tile classes the Triton kernel
reads) and otherwise by create_block_mask, which evaluates the predicate over every tile; either way
it is built once per shape and mask value and shared by every layer of the forward.

Where it serves (the capability check, measured by benchmarks/bench_attention.py):
* CUDA: training and prefill (from FLEX_MIN_QUERIES_CUDA queries; a decode step would compile again for
  every cache length). Measured on an H200 the Triton kernel is faster for every built-in and SPS mask
  (benchmarks/bench_attention.py), so this path serves CUDA calls the Triton kernel cannot: masks that
  declare no column runs (an architecture's own predicate).
* CPU: forward only, for evaluation and prefill: torch 2.13 has no FlexAttention backward on a CPU, so
  a call that autograd would differentiate is refused and goes to SDPA. It pays off only on long
  sequences (compiled FlexAttention measured 0.69x dense SDPA at T = 512, 2.8x at 2,048, 5.0x at
  4,096 with a document + SPS-like mask), so it serves from FLEX_MIN_KEYS keys on, and never for plain
  causal attention, which SDPA runs without a mask tensor.
Neither takes ALiBi or attention dropout (SDPA does).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.masks import Mask, is_causal
from kernels.attention.reference import check_heads
from kernels.attention.runs import tile_lists

FLEX_MIN_KEYS = 1024  # below this a CPU forward is faster through SDPA's dense mask
FLEX_MIN_QUERIES_CUDA = 128  # CUDA: training and prefill; decode steps go to the Triton kernel or SDPA
BLOCK = 128  # FlexAttention's default tile
HEAD_DIMS = (16, 32, 64, 128, 256)
_compiled = None


def _flex():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention
        # one compiled graph per shape and grad mode (training, evaluation); past dynamo's default limit
        # of 8 FlexAttention falls back to an unfused version 100x slower (seen on an H200), so allow more
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def refusal(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
            dropout_p: float = 0.0, alibi_slopes: Tensor | None = None, forced: bool = False) -> str | None:
    """Why this path cannot serve the call (None: it can). Python values only (dynamo traces it)."""
    if dropout_p or alibi_slopes is not None:
        return "it has no attention dropout or ALiBi"
    if q.shape[-1] not in HEAD_DIMS:
        return f"it takes head dims {', '.join(map(str, HEAD_DIMS))}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not (k.dtype == v.dtype == q.dtype):
        return "it takes fp32, bf16 or fp16 inputs of one dtype"
    if q.is_cuda:  # not for decode: every new cache length would compile again
        return None if q.shape[-2] >= FLEX_MIN_QUERIES_CUDA else \
            f"on CUDA it serves from {FLEX_MIN_QUERIES_CUDA} queries on (not decode steps)"
    if q.device.type != "cpu":
        return f"it runs on CUDA devices and CPUs, not on {q.device.type}"
    if _needs_grad(q, k, v):
        return "this torch has no FlexAttention backward on a CPU (training)"
    if k.shape[-2] < FLEX_MIN_KEYS:
        return f"on a CPU it serves from {FLEX_MIN_KEYS} keys on"
    if is_causal(mask, q.shape[-2], k.shape[-2], offset):
        return "plain causal attention on a CPU goes to SDPA"
    return None


def capable(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *args, **kwargs) -> bool:
    return refusal(q, k, v, mask, *args, **kwargs) is None


def block_mask(mask: Mask, B: int, Tq: int, Tk: int, offset: int, device):
    """The BlockMask of `mask` at this shape (cached on the mask value outside compiled regions)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    def mod(b, h, q, kv):  # four named arguments: FlexAttention reads the signature (`&` masks take *i)
        return mask.mask_mod(b, h, q + offset, kv)

    def build():
        if mask.runs is None:
            return create_block_mask(mod, B, None, Tq, Tk, device=device, BLOCK_SIZE=BLOCK)
        t = tile_lists(mask, B, Tq, Tk, offset, BLOCK, BLOCK, device)  # the Triton kernel's lists, Flex's layout
        return BlockMask.from_kv_blocks(t.q_partial_num[:, None], t.q_partial[:, None], t.q_full_num[:, None],
                                        t.q_full[:, None], BLOCK_SIZE=BLOCK, mask_mod=mod, seq_lengths=(Tq, Tk))

    return mask.cached(("flex", B, Tq, Tk, offset, str(device)), build)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None) -> Tensor:
    gqa = check_heads(q, k, v) > 1
    bm = block_mask(mask, q.shape[0], q.shape[-2], k.shape[-2], offset, q.device)
    return _flex()(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)
