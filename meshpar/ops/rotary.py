"""Rotary position embedding applied to q or k, rotate-half (GPT-NeoX / Llama) or interleaved (GPT-J) pairs.

``cos`` / ``sin`` are ``[seq, head_dim/2]`` (one angle per pair); HF-style ``[seq, head_dim]`` tables (the half
duplicated) are accepted for rotate-half. ``x`` is ``[..., seq, ..., head_dim]`` with the sequence at ``seq_dim``
(``-3`` for ``[b, s, h, d]``, ``-2`` for ``[b, h, s, d]``). The backward is the inverse rotation, so one op
``meshpar::rotary_embedding(x, cos, sin, interleaved, inner, inverse)`` serves both directions.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from meshpar.ops._dispatch import block_size, run_triton
from meshpar.ops._dtensor import on_local_shards
from meshpar.ops._eager import call, register_autograd
from meshpar.ops._triton import tl, triton

# Elements per half-row tile of one program: 64 rows of a 128-wide head (one row per program left most threads idle
# and ran at a third of torch.compile's speed on an H100).
_ROTARY_TILE = 4096


@triton.jit
def _rotary_kernel(
    X, COS, SIN, Y, n_rows, n_seq, inner, half, sign,
    INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program p rotates rows [p * BLOCK_R, (p + 1) * BLOCK_R) of ``x`` viewed as ``[rows, head_dim]``; a row's
    sequence position is ``(row // inner) % n_seq``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < n_rows) & (i[None, :] < half)
    angle = ((rows // inner) % n_seq)[:, None] * half + i[None, :]
    c = tl.load(COS + angle, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + angle, mask=mask, other=0.0).to(tl.float32) * sign
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + half
    base = rows[:, None] * 2 * half
    x1 = tl.load(X + base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + base + first[None, :], (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + base + second[None, :], (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inner: int, inverse: bool
) -> torch.Tensor:
    n_seq = cos.shape[0]
    rows = x.reshape(-1, inner, x.shape[-1]).float()  # [outer * seq, inner, d]
    pos = torch.arange(rows.shape[0], device=x.device) % n_seq
    c = cos.float()[pos].unsqueeze(1)
    s = sin.float()[pos].unsqueeze(1) * (-1.0 if inverse else 1.0)
    if interleaved:
        x1, x2 = rows[..., 0::2], rows[..., 1::2]
        y = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rows.chunk(2, dim=-1)
        y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return y.view_as(x).to(x.dtype)


@triton_op("meshpar::rotary_embedding", mutates_args=())
def rotary_embedding_op(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inner: int, inverse: bool
) -> torch.Tensor:
    if not run_triton(x):
        return rotary_reference(x, cos, sin, interleaved, inner, inverse)
    x = x.contiguous()
    y = torch.empty_like(x)
    half = x.shape[-1] // 2
    n_rows = x.numel() // x.shape[-1]
    block_h = block_size(half)
    block_r = max(1, min(_ROTARY_TILE // block_h, block_size(n_rows)))
    wrap_triton(_rotary_kernel)[(triton.cdiv(n_rows, block_r),)](
        x, cos.contiguous(), sin.contiguous(), y, n_rows, cos.shape[0], inner, half, -1.0 if inverse else 1.0,
        INTERLEAVED=interleaved, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4 if block_r * block_h <= 2048 else 8,
    )  # fmt: skip
    return y


@rotary_embedding_op.register_fake
def _(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inner: int, inverse: bool
) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    _, cos, sin, ctx.interleaved, ctx.inner, ctx.inverse = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx: object, dy: torch.Tensor) -> tuple:
    cos, sin = ctx.saved_tensors
    dx = call(rotary_embedding_op, dy, cos, sin, ctx.interleaved, ctx.inner, not ctx.inverse)
    return dx, None, None, None, None, None


register_autograd(rotary_embedding_op, _backward, _setup_context)


def rotary_embedding(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, seq_dim: int = -3
) -> torch.Tensor:
    """Rotate pairs of ``x``'s last dim by the angles of its sequence position (no grads for cos/sin)."""
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    if cos.shape[-1] == head_dim and not interleaved:
        cos, sin = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
    seq_dim = seq_dim % x.dim()
    if seq_dim == x.dim() - 1 or cos.shape != (x.shape[seq_dim], head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"cos/sin must be [seq={x.shape[seq_dim]}, {head_dim // 2}] for x {tuple(x.shape)} with seq_dim={seq_dim}, "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    inner = 1
    for size in x.shape[seq_dim + 1 : -1]:
        inner *= size
    return on_local_shards(
        lambda t: call(rotary_embedding_op, t, cos.detach(), sin.detach(), interleaved, inner, False), x
    )
