"""The one-device form of what the models import from parallel/ and kernels/ dispatch, for the remote
code (pretrain/hf_remote/bundle.py takes these in place of parallel.layers' names, and of the RT ops).

parallel.layers' facades build megatron-core's layers under tensor parallelism; on one device they are
nn.Linear and nn.Embedding with the same parameter names, which is all an exported model holds. The head
gives logits only (a remote model's loss is the wrapper's). Whatever parallel.layers defines and this
file does not (the norms, shift_right, ...) is taken from parallel.layers itself.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from kernels.norms import at_least_fp32
from kernels.rt_prefill import tiled


class ColumnLinear(nn.Linear):
    """nn.Linear; the init arguments of parallel.layers.ColumnLinear are accepted (weights are loaded)."""

    counts_as_embedding = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02,
                 stacked: int = 1, trunc: float = 0.0):
        super().__init__(in_features, out_features, bias=bias)
        self.init_std, self.trunc = init_std, trunc

    def reset_parameters(self) -> None:
        if not hasattr(self, "init_std"):
            return
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class RowLinear(ColumnLinear):
    """nn.Linear too (tensor parallelism splits it by input features; one device holds it whole)."""


class VocabEmbedding(nn.Embedding):
    counts_as_embedding = True

    def __init__(self, vocab_size: int, dim: int, init_std: float = 0.02):
        self.init_std = init_std
        super().__init__(vocab_size, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class LMHead(nn.Module):
    """The output projection (its weight the embedding's when `tied`); logits in float32 (float64 kept)."""

    counts_as_embedding = True

    def __init__(self, dim: int, vocab_size: int, tied: nn.Module | None = None, init_std: float = 0.02,
                 loss_chunk: int = 0):
        super().__init__()
        self.vocab_size = vocab_size
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def logits(self, h: Tensor) -> Tensor:
        return at_least_fp32(F.linear(h, self.weight))


def gather_sequence(x: Tensor) -> Tensor:
    return x  # one device holds the whole sequence


def local_sequence(x: Tensor) -> Tensor:
    return x


def rt_prefill(x: Tensor, layer, leaf: int = 1, offset: int = 0) -> Tensor:
    """kernels.rt_prefill's default path: the dyadic tile schedule in PyTorch."""
    return tiled.prefill(x, layer, leaf, offset)


def rt_decode(x: Tensor, layer, leaf: int, offset: int, prefix) -> tuple[Tensor, Tensor, Tensor]:
    """kernels.rt_prefill's decode: the same schedule after the cached prefix."""
    return tiled.forward(x, layer, leaf, offset, prefix)[:3]


def tokenizer_ids(run) -> None:
    """A run's tokenizer ids (pretrain.models.base): a loaded model has no run to check against."""
    return None
