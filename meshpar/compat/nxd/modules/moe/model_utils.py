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


def expert_activation(
    x: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    glu_type: GLUType | None,
    scaling: float = 1.0,
    bias: float = 0.0,
    gate_limits: tuple[float | None, float | None] = (None, None),
    up_limits: tuple[float | None, float | None] = (None, None),
) -> torch.Tensor:
    """An expert MLP's activation of its first projection's output ``x``: ``act(x)``, or with a ``glu_type`` the
    gated unit over ``x``'s halves (this rank's gate columns, then its up columns), each half clamped to its
    ``(lower, upper)`` limits first (a limit of 0 is one: NxD's ``Experts`` skips a falsy limit)."""
    if glu_type is None:
        return act(x)
    gate, up = x.chunk(2, dim=-1)
    if any(v is not None for v in gate_limits):
        gate = gate.clamp(*gate_limits)
    if any(v is not None for v in up_limits):
        up = up.clamp(*up_limits)
    activated = act(scaling * gate)
    if glu_type == GLUType.SWIGLU:
        activated = gate * activated
    return activated * (up + bias)


__all__ = ["ACT2FN", "DEFAULT_BLOCK_SIZE", "DEFAULT_LNC_SIZE", "GLUType", "expert_activation"]
