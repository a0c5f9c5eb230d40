"""safetensors files, written one tensor at a time.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}} padded
with spaces to a multiple of 8, then the tensors' bytes back to back (little-endian, C order).

Writing it here rather than through safetensors.torch.save_file keeps export's memory flat: that
function needs every tensor at once (and copies each into Python bytes before 0.6), while here a
converted tensor (a permuted or cast copy) exists only while it is being written. Reading goes
through the safetensors package (memory-mapped, one tensor at a time).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def write_safetensors(path: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      tensor_of: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
                      on_tensor: Callable[[int], None] | None = None) -> int:
    """Write `path` holding, in the order of `specs` ({name: (shape, dtype)}), the tensors
    `tensor_of(name)` returns (asked for one at a time, checked against its spec); fsynced. Returns
    the bytes written. `on_tensor(nbytes)` is called after each tensor (progress)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (shape, dtype) in specs.items():
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name} has dtype {dtype}, which safetensors cannot hold")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, (shape, dtype) in specs.items():
            t = tensor_of(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"tensor {name} is {tuple(t.shape)} {t.dtype}, declared {tuple(shape)} {dtype}")
            t = t.detach().to("cpu").contiguous()
            # Viewed as bytes, the tensor's own memory is written: no copy beyond .contiguous()'s.
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            if on_tensor is not None:
                on_tensor(t.numel() * t.element_size())
            del t
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + offset


def read_header(path: str) -> dict:
    """The JSON header of safetensors file `path` (names, dtypes, shapes, "__metadata__"), read
    without the safetensors package; ValueError in one sentence for a file that is not one."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
            if n is None or n > min(size - 8, 100 << 20):
                raise ValueError
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError
    except (ValueError, struct.error, UnicodeDecodeError):
        raise ValueError(f"{path} is not a safetensors file (unreadable header)") from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ValueError(f"{path} is not a safetensors file (a header entry has no data_offsets)") from None
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated ({size} bytes, its header describes {8 + n + end})")
    return header
