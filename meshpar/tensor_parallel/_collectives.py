"""Differentiable tensor-parallel collectives on local tensors (Megatron's mappings, picotron-style).

Each function is an ``autograd.Function`` whose forward and backward are one collective: the in-place c10d
collective in eager mode (no extra allocation, like Megatron) and the functional collective
(``torch.distributed._functional_collectives``) under ``torch.compile``, which traces it.

=========================  ===========================  ===========================
function                   forward                      backward
=========================  ===========================  ===========================
copy_to_tp                 identity                     all-reduce
reduce_from_tp             all-reduce                   identity
gather_from_tp(dim)        all-gather along dim         keep own chunk
scatter_to_tp(dim)         keep own chunk               all-gather along dim
gather_from_sp(dim)        all-gather along dim         reduce-scatter along dim
reduce_scatter_to_sp(dim)  reduce-scatter along dim     all-gather along dim
=========================  ===========================  ===========================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh, all_gather_single, funcol, reduce_scatter_single

_C10D_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _all_reduce(x: torch.Tensor, mesh: DeviceMesh, op: str = "sum") -> torch.Tensor:
    """In eager mode an in-place c10d all-reduce on a tensor nobody else holds (a matmul output or an incoming
    grad, as Megatron does); under ``torch.compile`` the functional collective the compiler can trace."""
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, mesh))
    x = x.contiguous()
    dist.all_reduce(x, op=_C10D_OPS[op], group=mesh.get_group())
    return x


def _all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    return funcol.wait_tensor(all_gather_single(x.contiguous(), dim % x.dim(), mesh))


def _reduce_scatter(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    dim = dim % x.dim()
    if x.shape[dim] % mesh.size() != 0:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over tp={mesh.size()}: "
            "the sequence length must be divisible by tp under sequence parallelism"
        )
    return funcol.wait_tensor(reduce_scatter_single(x.contiguous(), "sum", dim, mesh))


def _own_chunk(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    size = mesh.size()
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over tp={size}")
    return x.chunk(size, dim)[mesh.get_local_rank()].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.mesh), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        out = _all_reduce(x, mesh)
        if out is x:  # summed in place: say so, so the output is not an alias of the input (which FSDP2 warns of)
            ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim % x.dim()
        return _all_gather(x, mesh, ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _own_chunk(grad, ctx.mesh, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim % x.dim()
        return _own_chunk(x, mesh, ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.mesh, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim % x.dim()
        return _all_gather(x, mesh, ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.mesh, ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim % x.dim()
        return _reduce_scatter(x, mesh, ctx.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.mesh, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Enter a tp region with a replicated tensor: the backward sums the partial input grads."""
    return x if mesh.size() == 1 else _CopyToTP.apply(x, mesh)


def reduce_from_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Leave a tp region by summing partial results."""
    return x if mesh.size() == 1 else _ReduceFromTP.apply(x, mesh)


def gather_from_tp(x: torch.Tensor, mesh: DeviceMesh, dim: int = -1) -> torch.Tensor:
    return x if mesh.size() == 1 else _GatherFromTP.apply(x, mesh, dim)


def scatter_to_tp(x: torch.Tensor, mesh: DeviceMesh, dim: int = -1) -> torch.Tensor:
    return x if mesh.size() == 1 else _ScatterToTP.apply(x, mesh, dim)


def gather_from_sp(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """Sequence shards -> full sequence before a column-parallel layer (backward: reduce-scatter)."""
    return x if mesh.size() == 1 else _GatherFromSP.apply(x, mesh, dim)


def reduce_scatter_to_sp(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """Partial full-sequence results -> summed sequence shards after a row-parallel layer (backward: all-gather)."""
    return x if mesh.size() == 1 else _ReduceScatterToSP.apply(x, mesh, dim)


def scatter_to_sp(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """Replicated full sequence -> this rank's sequence shard (backward: all-gather)."""
    return scatter_to_tp(x, mesh, dim)


def all_reduce_sum(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Non-differentiable sum over tp."""
    return x if mesh.size() == 1 else _all_reduce(x, mesh, "sum")


def all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Non-differentiable all-gather over tp along ``dim`` (integer tensors: routing indices)."""
    return x if mesh.size() == 1 else _all_gather(x, mesh, dim)
