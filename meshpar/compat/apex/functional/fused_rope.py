"""``apex.transformer.functional.fused_rope``: rotary position embedding on ``[s, b, h, d]`` tensors.

``freqs`` is ``[s, 1, 1, d2]`` (``d2 <= d``): the first ``d2`` features of each head are rotated (halves paired, as
Megatron does), the rest pass through. Plain torch math, differentiable; apex's THD (packed) and 2-D variants are not
provided.
"""

from __future__ import annotations

import torch

__all__ = ["fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_cached"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    width = cos.shape[-1]
    if width > t.shape[-1]:
        raise ValueError(f"the rotary width {width} is larger than the head dim {t.shape[-1]}")
    rotated, rest = t[..., :width], t[..., width:]
    out = rotated * cos.to(t.dtype) + _rotate_half(rotated) * sin.to(t.dtype)
    return torch.cat((out, rest), dim=-1)


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """``t`` rotated by the angles ``freqs`` (``transpose_output_memory`` only changes apex's memory layout)."""
    return _apply(t, freqs.cos(), freqs.sin())


def fused_apply_rotary_pos_emb_cached(
    t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """As :func:`fused_apply_rotary_pos_emb`, with the angles' cosines and sines precomputed."""
    return _apply(t, cos_, sin_)
