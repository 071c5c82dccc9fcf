"""LayerNorm over the last dim with weight and bias, fp32 accumulation.

Ops: ``meshpar::layer_norm_fwd(x, weight, bias, eps) -> (y, mean, rstd)`` and
``meshpar::layer_norm_bwd(dy, x, weight, mean, rstd) -> (dx, dweight, dbias)``; same structure as RMSNorm.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from meshpar.ops._dispatch import block_size, num_warps, run_triton
from meshpar.ops._dtensor import on_local_shards
from meshpar.ops._eager import call, register_autograd
from meshpar.ops._rows import as_rows, grid_programs, sum_partials
from meshpar.ops._triton import tl, triton


@triton.jit
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (centered * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, stride, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        offset = row * stride
        x = tl.load(X + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        dyw = dy * w
        c1 = tl.sum(dyw * x_hat, axis=0) / n_cols
        c2 = tl.sum(dyw, axis=0) / n_cols
        dx = (dyw - x_hat * c1 - c2) * rstd
        tl.store(DX + offset + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)
    tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=mask)


def _aten_fused(*tensors: torch.Tensor) -> bool:
    """fp32 throughout: aten's own fused LayerNorm computes exactly this op (as fast as the stock module on CPU)."""
    return all(t.dtype == torch.float32 for t in tensors)


def layer_norm_fwd_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _aten_fused(x, weight, bias):
        y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
        return y, mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * weight.float() + bias.float()
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd_reference(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _aten_fused(dy, x, weight, mean, rstd):
        stats = (*x.shape[:-1], 1)
        # the bias argument only says that there is one (its grad is wanted); its values are not read
        return torch.ops.aten.native_layer_norm_backward(
            dy, x, [x.shape[-1]], mean.reshape(stats), rstd.reshape(stats), weight, weight, [True, True, True]
        )
    x_hat = (x.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dyw = dy.float() * weight.float()
    dx = (dyw - x_hat * (dyw * x_hat).mean(-1, keepdim=True) - dyw.mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    n = x.shape[-1]
    dw = (dy.float() * x_hat).reshape(-1, n).sum(0)
    db = dy.float().reshape(-1, n).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(weight.dtype)


@triton_op("meshpar::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not run_triton(x):
        return layer_norm_fwd_reference(x, weight, bias, eps)
    rows = as_rows(x)
    y = torch.empty_like(rows)
    mean = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block = block_size(rows.shape[1])
    wrap_triton(_layer_norm_fwd_kernel)[(rows.shape[0],)](
        rows, weight, bias, y, mean, rstd, rows.stride(0), y.stride(0), rows.shape[1], eps,
        BLOCK=block, num_warps=num_warps(block),
    )  # fmt: skip
    return y.view_as(x), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


@triton_op("meshpar::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not run_triton(x):
        return layer_norm_bwd_reference(dy, x, weight, mean, rstd)
    rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = rows.shape
    dx = torch.empty_like(rows)
    programs, rows_per_program = grid_programs(n_rows, x.device)
    dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    db_partial = torch.empty_like(dw_partial)
    block = block_size(n_cols)
    wrap_triton(_layer_norm_bwd_kernel)[(programs,)](
        dy_rows, rows, weight, mean, rstd, dx, dw_partial, db_partial, rows.stride(0), n_rows, n_cols,
        rows_per_program, BLOCK=block, num_warps=num_warps(block),
    )  # fmt: skip
    return dx.view_as(x), sum_partials(dw_partial, weight.dtype), sum_partials(db_partial, weight.dtype)


@layer_norm_fwd.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> tuple:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@layer_norm_bwd.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> tuple:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])


def _backward(ctx: object, dy: torch.Tensor, _dmean: torch.Tensor, _drstd: torch.Tensor) -> tuple:
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = call(layer_norm_bwd, dy.contiguous(), x, weight, mean, rstd)
    return dx, dw, db, None


register_autograd(layer_norm_fwd, _backward, _setup_context)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim; DTensor ``x`` (sharded over rows) works on local shards."""
    return on_local_shards(lambda t, w, b: call(layer_norm_fwd, t.contiguous(), w, b, eps)[0], x, weight, bias)
