"""``neuronx_distributed.modules.moe.model_utils``: the expert MLPs' activation table and gated-unit kinds."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F

ACT2FN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "leaky_relu": F.leaky_relu,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
}

DEFAULT_BLOCK_SIZE = 512  # NxD's blockwise-kernel block (accepted; the torch path has no blocks)
DEFAULT_LNC_SIZE = 1


class GLUType(Enum):
    """How a gated MLP combines its halves: ``GLU`` ``act(s * gate) * (up + b)``, ``SWIGLU``
    ``gate * act(s * gate) * (up + b)`` (``s`` the activation scaling, ``b`` the activation bias)."""

    GLU = "glu"
    SWIGLU = "swiglu"

    @classmethod
    def validate(cls, value: GLUType | str) -> GLUType:
        try:
            return value if isinstance(value, cls) else cls(str(value).lower())
        except ValueError:
            raise ValueError(f"glu_type must be one of {[t.value for t in cls]}, got {value!r}") from None


__all__ = ["ACT2FN", "DEFAULT_BLOCK_SIZE", "DEFAULT_LNC_SIZE", "GLUType"]
