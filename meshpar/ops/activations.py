"""Fused elementwise activations: Megatron's ``bias_gelu`` (tanh approximation) and ``swiglu``.

Ops: ``meshpar::bias_gelu_fwd(x, bias)``, ``meshpar::bias_gelu_bwd(dy, x, bias) -> (dx, dbias)`` (the bias grad,
the row sum of ``dx``, is accumulated per program while ``dx`` is written, so ``dx`` is never read back),
``meshpar::swiglu_fwd(gate, up)``, ``meshpar::swiglu_bwd(dy, gate, up) -> (dgate, dup)``. Nothing
but the inputs is saved for backward; the activation is recomputed in registers.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from meshpar.ops._dispatch import run_triton
from meshpar.ops._dtensor import on_local_shards
from meshpar.ops._eager import call, register_autograd
from meshpar.ops._rows import as_rows, grid_programs, sum_partials
from meshpar.ops._triton import tl, triton

_BLOCK = 1024
_BWD_BLOCK_ROWS = 16
_BWD_BLOCK_COLS = 128
_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, n, n_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(B + offs % n_cols, mask=mask).to(tl.float32)
    y = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_PARTIAL, n_rows, n_cols, rows_per_program, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """Program (c, r) owns column strip c of row range r; it writes dx and its strip's bias-grad partial."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    bias = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    start = tl.program_id(1) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    db = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for row0 in range(start, end, BLOCK_R):
        rows = row0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < end) & col_mask[None, :]
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        grad = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * z * z)
        dx = (dy * grad).to(DX.dtype.element_ty)
        tl.store(DX + offs, dx, mask=mask)
        db += tl.where(mask, dx.to(tl.float32), 0.0)
    tl.store(DB_PARTIAL + tl.program_id(1) * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DG + offs, (dy * u * (sig + silu * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float() + bias.float(), approximate="tanh").to(x.dtype)


def bias_gelu_bwd_reference(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = x.float() + bias.float()
    t = torch.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z.pow(3)))
    grad = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    dx = (dy.float() * grad).to(x.dtype)
    return dx, dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu_bwd_reference(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, dyf = gate.float(), up.float(), dy.float()
    # aten's fused silu backward: fewer passes and temporaries than spelling out sigmoid's derivative
    dgate = torch.ops.aten.silu_backward(dyf * u, g)
    return dgate.to(gate.dtype), (dyf * torch.nn.functional.silu(g)).to(up.dtype)


@triton_op("meshpar::bias_gelu_fwd", mutates_args=())
def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if not run_triton(x):
        return bias_gelu_reference(x, bias)
    x = x.contiguous()
    y = torch.empty_like(x)
    wrap_triton(_bias_gelu_fwd_kernel)[_grid(x.numel())](x, bias, y, x.numel(), x.shape[-1], BLOCK=_BLOCK)
    return y


@triton_op("meshpar::bias_gelu_bwd", mutates_args=())
def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not run_triton(x):
        return bias_gelu_bwd_reference(dy, x, bias)
    rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = rows.shape
    dx = torch.empty_like(rows)
    col_blocks = triton.cdiv(n_cols, _BWD_BLOCK_COLS)
    row_programs, rows_per_program = grid_programs(n_rows, x.device, programs_per_sm=8, column_blocks=col_blocks)
    db_partial = torch.empty(row_programs, n_cols, dtype=torch.float32, device=x.device)
    wrap_triton(_bias_gelu_bwd_kernel)[(col_blocks, row_programs)](
        dy_rows, rows, bias, dx, db_partial, n_rows, n_cols, rows_per_program,
        BLOCK_R=_BWD_BLOCK_ROWS, BLOCK_C=_BWD_BLOCK_COLS, num_warps=4,
    )  # fmt: skip
    return dx.view_as(x), sum_partials(db_partial, bias.dtype)


@triton_op("meshpar::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not run_triton(gate):
        return swiglu_reference(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    wrap_triton(_swiglu_fwd_kernel)[_grid(gate.numel())](gate, up, y, gate.numel(), BLOCK=_BLOCK)
    return y


@triton_op("meshpar::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not run_triton(gate):
        return swiglu_bwd_reference(dy, gate, up)
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    wrap_triton(_swiglu_bwd_kernel)[_grid(gate.numel())](dy, gate, up, dgate, dup, gate.numel(), BLOCK=_BLOCK)
    return dgate, dup


@bias_gelu_fwd.register_fake
def _(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@bias_gelu_bwd.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(bias)


@swiglu_fwd.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


@swiglu_bwd.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _save_inputs(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _bias_gelu_backward(ctx: object, dy: torch.Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    return call(bias_gelu_bwd, dy, x, bias)


def _swiglu_backward(ctx: object, dy: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors
    return call(swiglu_bwd, dy, gate, up)


register_autograd(bias_gelu_fwd, _bias_gelu_backward, _save_inputs)
register_autograd(swiglu_fwd, _swiglu_backward, _save_inputs)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x + bias)``, bias over the last dim (e.g. the local fc1 shard of a column-parallel layer)."""
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must be [{x.shape[-1]}] for x of shape {tuple(x.shape)}, got {tuple(bias.shape)}")
    return on_local_shards(lambda t, b: call(bias_gelu_fwd, t, b), x, bias)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Llama's MLP), elementwise; shapes must match."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return on_local_shards(lambda g, u: call(swiglu_fwd, g, u), gate, up)
