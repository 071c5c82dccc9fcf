"""apex's fused softmaxes: ``softmax(scale * x masked)`` over the last dim of attention scores ``[b, h, sq, sk]``.

- ``scaled_masked_softmax(x, mask, scale)``: ``mask`` is bool, broadcastable to ``x``, ``True`` = masked out; masked
  scores are set to -10000 before the softmax (apex's convention: a fully masked row becomes uniform).
- ``scaled_upper_triang_masked_softmax(x, scale)``: causal; key ``j > i`` (query ``i`` of ``sq``) gets probability 0.

Backward (both): ``dx = scale * y * (dy - sum(dy * y))``, one op ``meshpar::scaled_softmax_bwd``.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from meshpar.ops._dispatch import block_size, num_warps, run_triton
from meshpar.ops._dtensor import on_local_shards
from meshpar.ops._eager import call, register_autograd
from meshpar.ops._triton import tl, triton

_MASK_FILL = -10000.0


@triton.jit
def _softmax_fwd_kernel(
    X, MASK, Y, n_cols, n_q, scale, mask_s0, mask_s1, mask_s2, n_heads, HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        q = row % n_q
        h = (row // n_q) % n_heads
        b = row // (n_q * n_heads)
        masked = tl.load(MASK + b * mask_s0 + h * mask_s1 + q * mask_s2 + cols, mask=inside, other=1)
        x = tl.where(masked != 0, -10000.0, x)
    if CAUSAL:
        q = row % n_q
        x = tl.where(cols > q, float("-inf"), x)
    x = tl.where(inside, x, float("-inf"))
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(Y + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_bwd_kernel(DY, Y, DX, n_cols, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    y = tl.load(Y + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=0))
    tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=inside)


def scaled_masked_softmax_reference(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = x.float() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, _MASK_FILL)
    return torch.softmax(scores, dim=-1).to(x.dtype)


def scaled_upper_triang_masked_softmax_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    sq, sk = x.shape[-2:]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x.float() * scale).masked_fill(causal, float("-inf")), dim=-1).to(x.dtype)


def scaled_softmax_bwd_reference(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    yf, dyf = y.float(), dy.float()
    return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


def _launch_fwd(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    x = x.contiguous()
    b, h, sq, sk = x.shape
    y = torch.empty_like(x)
    if mask is not None:
        mask = mask.expand(b, h, sq, sk)
        strides = mask.stride()
        if strides[3] != 1:
            mask = mask.contiguous()
            strides = mask.stride()
        mask_arg = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    else:
        strides, mask_arg = (0, 0, 0, 1), x
    block = block_size(sk)
    wrap_triton(_softmax_fwd_kernel)[(b * h * sq,)](
        x, mask_arg, y, sk, sq, scale, strides[0], strides[1], strides[2], h,
        HAS_MASK=mask is not None, CAUSAL=causal, BLOCK=block, num_warps=num_warps(block),
    )  # fmt: skip
    return y


@triton_op("meshpar::scaled_masked_softmax", mutates_args=())
def scaled_masked_softmax_op(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    if not run_triton(x):
        return scaled_masked_softmax_reference(x, mask, scale)
    return _launch_fwd(x, mask, scale, causal=False)


@triton_op("meshpar::scaled_upper_triang_masked_softmax", mutates_args=())
def scaled_upper_triang_masked_softmax_op(x: torch.Tensor, scale: float) -> torch.Tensor:
    if not run_triton(x):
        return scaled_upper_triang_masked_softmax_reference(x, scale)
    return _launch_fwd(x, None, scale, causal=True)


@triton_op("meshpar::scaled_softmax_bwd", mutates_args=())
def scaled_softmax_bwd(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    if not run_triton(y):
        return scaled_softmax_bwd_reference(dy, y, scale)
    dy, y = dy.contiguous(), y.contiguous()
    dx = torch.empty_like(y)
    block = block_size(y.shape[-1])
    wrap_triton(_softmax_bwd_kernel)[(y.numel() // y.shape[-1],)](
        dy, y, dx, y.shape[-1], scale, BLOCK=block, num_warps=num_warps(block)
    )
    return dx


@scaled_masked_softmax_op.register_fake
def _(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@scaled_upper_triang_masked_softmax_op.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@scaled_softmax_bwd.register_fake
def _(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(y)


def _save_output(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.scale = inputs[-1]


def _save_output_and_mask(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(output, inputs[1])
    ctx.scale = inputs[-1]


def _masked_backward(ctx: object, dy: torch.Tensor) -> tuple:
    y, mask = ctx.saved_tensors
    dx = call(scaled_softmax_bwd, dy, y, ctx.scale)
    # Masked scores are constants: their grad is 0. (Only fully masked rows need this; elsewhere y is exactly 0.)
    return (dx if mask is None else dx.masked_fill(mask, 0.0)), None, None


def _causal_backward(ctx: object, dy: torch.Tensor) -> tuple:
    (y,) = ctx.saved_tensors
    return call(scaled_softmax_bwd, dy, y, ctx.scale), None


register_autograd(scaled_masked_softmax_op, _masked_backward, _save_output_and_mask)
register_autograd(scaled_upper_triang_masked_softmax_op, _causal_backward, _save_output)


def _check_4d(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"attention scores must be [batch, heads, sq, sk], got shape {tuple(x.shape)}")


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
    """apex ``scaled_masked_softmax``; ``x`` may be a DTensor sharded over batch or heads."""
    _check_4d(x)
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = masked out), got {mask.dtype}")
    return on_local_shards(lambda t: call(scaled_masked_softmax_op, t, mask, scale), x)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """apex ``scaled_upper_triang_masked_softmax`` (causal) on ``[b, h, sq, sk]`` scores."""
    _check_4d(x)
    return on_local_shards(lambda t: call(scaled_upper_triang_masked_softmax_op, t, scale), x)
