"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim, fp32 accumulation.

Ops: ``meshpar::rms_norm_fwd(x, weight, eps) -> (y, rstd)`` and ``meshpar::rms_norm_bwd(dy, x, weight, rstd) ->
(dx, dweight)``. One program per row forward; backward programs each own a contiguous block of rows and accumulate
their partial ``dweight`` in registers (one fp32 row per program, summed afterwards by ``sum_partials``).
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
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, stride, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        offset = row * stride
        x = tl.load(X + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        dyw = dy * w
        dx = (dyw - x_hat * (tl.sum(dyw * x_hat, axis=0) / n_cols)) * rstd
        tl.store(DX + offset + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def rms_norm_fwd_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd.unsqueeze(-1) * weight.float()).to(x.dtype), rstd


def rms_norm_bwd_reference(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x_hat = x.float() * rstd.unsqueeze(-1)
    dyw = dy.float() * weight.float()
    dx = (dyw - x_hat * (dyw * x_hat).mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    dw = (dy.float() * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@triton_op("meshpar::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not run_triton(x):
        return rms_norm_fwd_reference(x, weight, eps)
    rows = as_rows(x)
    y = torch.empty_like(rows)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    block = block_size(rows.shape[1])
    wrap_triton(_rms_norm_fwd_kernel)[(rows.shape[0],)](
        rows, weight, y, rstd, rows.stride(0), y.stride(0), rows.shape[1], eps, BLOCK=block, num_warps=num_warps(block)
    )
    return y.view_as(x), rstd.view(x.shape[:-1])


@triton_op("meshpar::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not run_triton(x):
        return rms_norm_bwd_reference(dy, x, weight, rstd)
    rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = rows.shape
    dx = torch.empty_like(rows)
    programs, rows_per_program = grid_programs(n_rows, x.device)
    dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    block = block_size(n_cols)
    wrap_triton(_rms_norm_bwd_kernel)[(programs,)](
        dy_rows, rows, weight, rstd, dx, dw_partial, rows.stride(0), n_rows, n_cols, rows_per_program,
        BLOCK=block, num_warps=num_warps(block),
    )  # fmt: skip
    return dx.view_as(x), sum_partials(dw_partial, weight.dtype)


@rms_norm_fwd.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@rms_norm_bwd.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx: object, dy: torch.Tensor, _drstd: torch.Tensor) -> tuple:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = call(rms_norm_bwd, dy.contiguous(), x, weight, rstd)
    return dx, dw, None


register_autograd(rms_norm_fwd, _backward, _setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim; DTensor ``x`` (sharded over rows) works on local shards."""
    return on_local_shards(lambda t, w: call(rms_norm_fwd, t.contiguous(), w, eps)[0], x, weight)
