"""``apex.transformer.functional.fused_rope``: rotary position embedding in apex's three layouts.

- ``sbhd`` (:func:`fused_apply_rotary_pos_emb`, ``..._cached``): ``t`` is ``[s, b, h, d]``, the angles ``[s, 1, 1, d2]``
  (``d2 <= d``): the first ``d2`` features of each head are rotated (their halves paired, as Megatron does), the rest
  pass through.
- ``thd`` (:func:`fused_apply_rotary_pos_emb_thd`): packed sequences ``[t, h, d]`` cut by ``cu_seqlens``; every
  sequence starts at position 0.
- 2-D (:func:`fused_apply_rotary_pos_emb_2d`): ``[b, img_h * img_w, h, d]`` image patches; the first half of each head
  is rotated by the patch's row, the second half by its column.

apex runs CUDA kernels; here each autograd class is plain torch math whose backward is the adjoint rotation
(``g * cos - rotate_half(g * sin)``), so it runs on every device and dtype and needs no saved activations.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FusedRoPE2DFunc",
    "FusedRoPECachedFunc",
    "FusedRoPEFunc",
    "FusedRoPETHDFunc",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool = False) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` features (the rest pass through);
    ``adjoint``: the transpose of that map, ``x * cos - rotate_half(x * sin)``, which is its backward."""
    width = cos.shape[-1]
    if width > x.shape[-1] or width % 2:
        raise ValueError(f"the rotary width {width} must be even and at most the head dim {x.shape[-1]}")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    part = x[..., :width]
    turned = part * cos - _rotate_half(part * sin) if adjoint else part * cos + _rotate_half(part) * sin
    if width == x.shape[-1]:
        return turned
    return torch.cat((turned, x[..., width:]), dim=-1)


def _sbhd_layout(out: torch.Tensor, transpose_output_memory: bool) -> torch.Tensor:
    """apex's output memory: ``[s, b, h, d]`` contiguous, or (``transpose_output_memory``) a view of a contiguous
    ``[b, s, h, d]`` tensor."""
    if transpose_output_memory:
        return out.transpose(0, 1).contiguous().transpose(0, 1)
    return out.contiguous()


class FusedRoPEFunc(torch.autograd.Function):
    """``sbhd`` rotary embedding from the angles ``freqs`` (``[s, 1, 1, d2]``)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False) -> torch.Tensor:
        cos, sin = freqs.cos(), freqs.sin()
        ctx.save_for_backward(cos, sin)
        return _sbhd_layout(_rotate(t, cos, sin), transpose_output_memory)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad_output, cos, sin, adjoint=True), None, None


class FusedRoPECachedFunc(torch.autograd.Function):
    """As :class:`FusedRoPEFunc`, with the angles' cosines and sines precomputed."""

    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, transpose_output_memory: bool = False
    ) -> torch.Tensor:
        ctx.save_for_backward(cos_, sin_)
        return _sbhd_layout(_rotate(t, cos_, sin_), transpose_output_memory)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad_output, cos, sin, adjoint=True), None, None, None


def _thd_angles(cu_seqlens: torch.Tensor, freqs: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed token's cosines and sines (``[t, 1, d2]``): its position inside its own sequence."""
    starts = cu_seqlens.to(torch.long)
    if starts.dim() != 1 or starts.numel() < 2 or int(starts[0]) != 0 or int(starts[-1]) != tokens:
        raise ValueError(
            f"cu_seqlens must run from 0 to the number of packed tokens ({tokens}), got {cu_seqlens.tolist()}"
        )
    lengths = starts[1:] - starts[:-1]
    if int(lengths.min()) < 0 or int(lengths.max()) > freqs.shape[0]:
        raise ValueError(f"sequence lengths {lengths.tolist()} must lie in [0, {freqs.shape[0]}] (freqs' length)")
    positions = torch.arange(tokens, device=freqs.device) - torch.repeat_interleave(starts[:-1], lengths).to(
        freqs.device
    )
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1])[positions].unsqueeze(1)
    return angles.cos(), angles.sin()


class FusedRoPETHDFunc(torch.autograd.Function):
    """``thd`` (packed) rotary embedding: ``t`` ``[t, h, d]``, ``cu_seqlens`` ``[b + 1]``, ``freqs`` ``[max_s, 1, 1,
    d2]``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        cos, sin = _thd_angles(cu_seqlens, freqs, t.shape[0])
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad_output, cos, sin, adjoint=True), None, None


def _rotate_2d(
    x: torch.Tensor, img_h: int, img_w: int, tables: tuple[torch.Tensor, ...], adjoint: bool = False
) -> torch.Tensor:
    """``x`` ``[b, img_h * img_w, h, d]``: the first half of each head rotated by the row, the second by the column."""
    cos_h, sin_h, cos_w, sin_w = tables
    grid = x.reshape(x.shape[0], img_h, img_w, x.shape[2], x.shape[3])
    rows, cols = grid.chunk(2, dim=-1)
    rows = _rotate(rows, cos_h[:, :img_h].unsqueeze(2), sin_h[:, :img_h].unsqueeze(2), adjoint)
    cols = _rotate(cols, cos_w[:, :img_w].unsqueeze(1), sin_w[:, :img_w].unsqueeze(1), adjoint)
    return torch.cat((rows, cols), dim=-1).reshape(x.shape)


class FusedRoPE2DFunc(torch.autograd.Function):
    """2-D rotary embedding of image patches (see :func:`fused_apply_rotary_pos_emb_2d`)."""

    @staticmethod
    def forward(
        ctx: Any,
        t: torch.Tensor,
        img_h: int,
        img_w: int,
        cos_h: torch.Tensor,
        sin_h: torch.Tensor,
        cos_w: torch.Tensor,
        sin_w: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(cos_h, sin_h, cos_w, sin_w)
        ctx.img_h, ctx.img_w = img_h, img_w
        return _rotate_2d(t, img_h, img_w, (cos_h, sin_h, cos_w, sin_w))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = _rotate_2d(grad_output, ctx.img_h, ctx.img_w, ctx.saved_tensors, adjoint=True)
        return grad, None, None, None, None, None, None


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """``t`` (``[s, b, h, d]``) rotated by the angles ``freqs`` (``[s, 1, 1, d2]``); ``transpose_output_memory``: the
    result is laid out as ``[b, s, h, d]`` in memory."""
    return FusedRoPEFunc.apply(t, freqs, transpose_output_memory)


def fused_apply_rotary_pos_emb_cached(
    t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """As :func:`fused_apply_rotary_pos_emb`, with the angles' cosines and sines precomputed."""
    return FusedRoPECachedFunc.apply(t, cos_, sin_, transpose_output_memory)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Packed sequences ``t`` (``[t, h, d]``, boundaries ``cu_seqlens``), each rotated from position 0 by ``freqs``
    (``[max_s, 1, 1, d2]``)."""
    return FusedRoPETHDFunc.apply(t, cu_seqlens, freqs)


def fused_apply_rotary_pos_emb_2d(
    t: torch.Tensor,
    img_h: int,
    img_w: int,
    cos_h: torch.Tensor,
    sin_h: torch.Tensor,
    cos_w: torch.Tensor,
    sin_w: torch.Tensor,
) -> torch.Tensor:
    """Image patches ``t`` (``[b, img_h * img_w, h, d]``, row-major): the first half of each head rotated by the
    patch's row (``cos_h`` / ``sin_h``: ``[1, H >= img_h, 1, d/2]``), the second by its column (``[1, W >= img_w, 1,
    d/2]``)."""
    if t.shape[1] != img_h * img_w:
        raise ValueError(f"the sequence length {t.shape[1]} must equal img_h * img_w = {img_h} * {img_w}")
    if cos_h.shape != sin_h.shape or cos_w.shape != sin_w.shape:
        raise ValueError("cos_h / sin_h and cos_w / sin_w must have the same shapes")
    if cos_h.shape[1] < img_h or cos_w.shape[1] < img_w:
        raise ValueError(f"the tables cover {cos_h.shape[1]} x {cos_w.shape[1]} patches, fewer than {img_h} x {img_w}")
    return FusedRoPE2DFunc.apply(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
