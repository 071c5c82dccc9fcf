"""``neuronx_distributed.overrides.transformer_overrides``: NxD's rotary position embedding for its Llama example,
including the transposed ``[b, h, d, s]`` layout its flash-attention kernel takes (``flash_attn`` with
``transpose_nki_inputs``): the half-rotation then runs along dim -2."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor, flash_attn: bool = False, transpose: bool = False) -> torch.Tensor:
    """``[-x2, x1]`` of the two halves of the head dim (dim -1, or dim -2 in the transposed layout)."""
    dim = -2 if flash_attn and transpose else -1
    first, second = x.chunk(2, dim=dim)
    return torch.cat((-second, first), dim=dim)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    flash_attn: bool = False,
    transpose_nki_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` (``[b, h, s, d]``) rotated by ``cos`` / ``sin`` (``[s, d]`` tables indexed by
    ``position_ids``, or already ``[b, s, d]``)."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, d]
    transposed = flash_attn and transpose_nki_inputs
    if transposed:
        cos, sin = cos.transpose(-1, -2), sin.transpose(-1, -2)
    q_out = q * cos + rotate_half(q, flash_attn, transpose_nki_inputs) * sin
    k_out = k * cos + rotate_half(k, flash_attn, transpose_nki_inputs) * sin
    return q_out, k_out


__all__ = ["apply_rotary_pos_emb", "rotate_half"]
