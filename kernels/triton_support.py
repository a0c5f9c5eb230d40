"""Where a Triton kernel can run: on a CUDA device with Triton installed, or on a CPU under Triton's
interpreter (TRITON_INTERPRET=1, how the tests run the kernels). Whether Triton is installed is looked
up once, at import; Triton itself is imported only by the kernel modules, on their first call."""
from __future__ import annotations

import importlib.util
import os

from torch import Tensor

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_can_run(t: Tensor) -> bool:
    """Whether Triton kernels can take tensor t where it lives."""
    return HAVE_TRITON and (t.is_cuda or (t.device.type == "cpu" and interpreting()))
