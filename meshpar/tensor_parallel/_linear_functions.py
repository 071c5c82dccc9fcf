"""One autograd node per tensor-parallel linear layer on the eager hot path (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``).

The composed path (``copy_to_tp`` -> ``weight.to_local()`` -> ``F.linear``) records four autograd nodes per layer and
builds DTensor grads through DTensor's autograd. These functions take the DTensor parameters as inputs, compute on
their local shards, and in backward start the all-reduce of the input grad asynchronously, compute the weight grad
while it is in flight, and hand back DTensor grads with the parameters' own placements. ``torch.compile`` keeps the
composed path (the compiler fuses it itself).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar._compat import (
    DeviceMesh,
    DTensor,
    all_reduce_start,
    all_reduce_wait,
    dist_all_gather_single,
    dist_reduce_scatter_single,
    dtensor_like,
    grad_needed,
    local_tensor,
)
from meshpar.tensor_parallel._collectives import _all_gather, _reduce_scatter


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def matrix(w: torch.Tensor, in_out: bool = False) -> torch.Tensor:
    """A local weight as ``F.linear`` takes it (``[out, in]``), as a view: packed layers keep ``[parts, rows, in]`` or
    ``[groups, rows, in]`` (:mod:`meshpar.tensor_parallel.packed`), whose local shard flattens to ``[rows, in]``;
    ``in_out`` weights are stored ``[in, out]`` (HF's ``Conv1D``; GPT-2's fused QKV ``[in, parts, rows]``) and are
    transposed (``F.linear`` takes a transposed weight without a copy)."""
    if in_out:
        return w.flatten(1).t()
    return w if w.dim() == 2 else w.flatten(0, -2)


def _weight_grad(grad_out: torch.Tensor, x: torch.Tensor, in_out: bool) -> torch.Tensor:
    """The local weight's grad in its stored orientation (``[out, in]``, or ``[in, out]`` for ``in_out``)."""
    return _flat(x).t() @ _flat(grad_out) if in_out else _flat(grad_out).t() @ _flat(x)


def vector(b: torch.Tensor | None) -> torch.Tensor | None:
    """A local bias as ``F.linear`` takes it (packed layers keep it ``[parts, rows]``), as a view."""
    return b if b is None or b.dim() == 1 else b.reshape(-1)


def _autocast_operands(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, the operands cast as ``F.linear`` would cast them (to autocast's dtype), so that what is saved
    for backward has the output grad's dtype: backward runs outside autocast and would otherwise mix dtypes in its
    matmuls. Outside autocast: unchanged."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, w, b
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), w.to(dtype), b.to(dtype) if b is not None else None


def _dtensor_grads(
    ctx: Any, grad_x: torch.Tensor | None, grad_w: torch.Tensor | None, grad_b: torch.Tensor | None
) -> tuple[torch.Tensor | None, DTensor | None, DTensor | None, None]:
    """Backward's return for ``(x, weight, bias, mesh)``: local weight/bias grads wrapped like the parameters (in
    their dtype: under autocast the grads were computed in autocast's)."""
    weight, bias = ctx.weight, ctx.bias  # grads in the parameters' local shapes (packed layers: N-D)
    return (
        grad_x,
        dtensor_like(grad_w.to(weight.dtype).view(local_tensor(weight).shape), weight) if grad_w is not None else None,
        dtensor_like(grad_b.to(bias.dtype).view(local_tensor(bias).shape), bias) if grad_b is not None else None,
        None,
    )


def _needed(ctx: Any) -> tuple[bool, bool, bool]:
    """Which of ``(x, weight, bias)`` this backward pass needs grads for: all of them in a full backward; the input
    or the weights only in a zero-bubble schedule's split passes (:mod:`meshpar.pipeline._split_backward`), which
    then skip the other half's matmuls and collectives. The forwards take ``(x, weight, bias, mesh, ...)``."""
    return grad_needed(ctx, 0), grad_needed(ctx, 1), ctx.bias is not None and grad_needed(ctx, 2)


class ColumnLinearFunction(torch.autograd.Function):
    """``y = x W_r^T + b_r`` for a replicated ``x``; backward all-reduces ``dx`` over tp, overlapped with ``dW``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: DTensor, bias: DTensor | None, mesh: DeviceMesh, in_out: bool = False
    ) -> torch.Tensor:
        b = vector(local_tensor(bias)) if bias is not None else None
        x, w, b = _autocast_operands(x, matrix(local_tensor(weight), in_out), b)
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.bias, ctx.mesh, ctx.in_out = weight, bias, mesh, in_out
        return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = _needed(ctx)
        grad_x = grad_out @ w if need_x else None
        work = None
        if need_x and ctx.mesh.size() > 1:
            work = dist.all_reduce(grad_x, group=ctx.mesh.get_group(), async_op=True)
        grad_w = _weight_grad(grad_out, x, ctx.in_out) if need_w else None
        grad_b = _flat(grad_out).sum(0) if need_b else None
        if work is not None:
            work.wait()
        return (*_dtensor_grads(ctx, grad_x, grad_w, grad_b), None)


class ColumnLinearSequenceParallelFunction(torch.autograd.Function):
    """Sequence-parallel column linear as one node: all-gather the sequence shards of ``x`` ``[b, s/tp, h]``, then
    ``y = x W_r^T + b_r``; backward starts the reduce-scatter of ``dx`` over the sequence asynchronously and computes
    the weight grad while it is in flight (Megatron's SP linear).

    ``regather=False`` saves the gathered ``[b, s, h]`` input for the weight grad: the fewest collectives (the
    Megatron minimum of one all-gather and one reduce-scatter per direction). ``regather=True`` saves only the
    shard, as Megatron does, and backward all-gathers it again while it computes the input grad: the saved input
    shrinks to ``1/tp`` for one more all-gather per layer input, hidden behind a matmul."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: DTensor,
        bias: DTensor | None,
        mesh: DeviceMesh,
        regather: bool = False,
        in_out: bool = False,
    ) -> torch.Tensor:
        b = vector(local_tensor(bias)) if bias is not None else None
        x, w, b = _autocast_operands(x, matrix(local_tensor(weight), in_out), b)
        full = _all_gather(x, mesh, 1)  # after the cast: under autocast the gather moves half the bytes
        ctx.save_for_backward(x if regather else full, w)
        ctx.weight, ctx.bias, ctx.mesh, ctx.regather, ctx.in_out = weight, bias, mesh, regather, in_out
        return torch.nn.functional.linear(full, w, b)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        saved, w = ctx.saved_tensors
        group, tp = ctx.mesh.get_group(), ctx.mesh.size()
        need_x, need_w, need_b = _needed(ctx)
        gather = scatter = shard = grad_w = None
        if ctx.regather and need_w:  # all_gather_into_tensor works on dim 0: gather the shards sequence-first
            shard_seq_first = saved.transpose(0, 1).contiguous()
            gathered = shard_seq_first.new_empty((shard_seq_first.shape[0] * tp, *shard_seq_first.shape[1:]))
            gather = dist_all_gather_single(gathered, shard_seq_first, group=group, async_op=True)
        if need_x:  # reduce_scatter_tensor splits dim 0: put the sequence first
            grad_full = (grad_out @ w).transpose(0, 1).contiguous()
            shard = grad_full.new_empty((grad_full.shape[0] // tp, *grad_full.shape[1:]))
        if gather is not None:
            gather.wait()
            saved = gathered.transpose(0, 1)  # [b, s, h]
        if need_x:
            scatter = dist_reduce_scatter_single(shard, grad_full, group=group, async_op=True)
        if need_w:
            grad_w = _weight_grad(grad_out, saved, ctx.in_out)
        grad_b = _flat(grad_out).sum(0) if need_b else None
        if scatter is not None:
            scatter.wait()
        grad_x = shard.transpose(0, 1) if need_x else None
        return (*_dtensor_grads(ctx, grad_x, grad_w, grad_b), None, None)


class ColumnLinearLocalFunction(torch.autograd.Function):
    """The traceable twin of :class:`ColumnLinearFunction` for ``torch.compile``: it takes the *local* weight and
    bias (``weight.to_local()``, which the compiler traces) and uses functional collectives. The backward issues the
    input-grad all-reduce before the weight-grad matmul and waits after it, so the compiled graph keeps Megatron's
    overlap; composed ops (``copy_to_tp`` + ``F.linear``) would put the all-reduce after both matmuls."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mesh: DeviceMesh) -> torch.Tensor:
        ctx.dtypes = (w.dtype, b.dtype if b is not None else None)
        x, w, b = _autocast_operands(x, w, b)
        ctx.save_for_backward(x, w)
        ctx.mesh, ctx.has_bias = mesh, b is not None
        return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        communicate = ctx.mesh.size() > 1
        grad_x = grad_out @ w
        if communicate:
            grad_x = all_reduce_start(grad_x, ctx.mesh)  # in flight during the weight-grad matmul
        grad_w = _flat(grad_out).t() @ _flat(x)
        grad_b = _flat(grad_out).sum(0).to(ctx.dtypes[1]) if ctx.has_bias else None
        return all_reduce_wait(grad_x) if communicate else grad_x, grad_w.to(ctx.dtypes[0]), grad_b, None


class RowLinearFunction(torch.autograd.Function):
    """``y = sum_r x_r W_r^T + b`` (all-reduced in place, the replicated bias added once after the reduction);
    backward needs no communication.

    Taking the bias here instead of ``y + bias.to_local()`` saves the ``to_local`` autograd node, whose backward
    rebuilds a DTensor through ``DTensor.from_local`` (the costliest host-side step of the layer's backward)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: DTensor, bias: DTensor | None, mesh: DeviceMesh, in_out: bool = False
    ) -> torch.Tensor:
        b = local_tensor(bias) if bias is not None else None
        x, w, b = _autocast_operands(x, matrix(local_tensor(weight), in_out), b)
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.bias, ctx.in_out = weight, bias, in_out
        if mesh.size() == 1:  # nothing to reduce: the bias goes into the matmul's epilogue (one addmm)
            return torch.nn.functional.linear(x, w, b)
        y = torch.nn.functional.linear(x, w)
        dist.all_reduce(y, group=mesh.get_group())
        if b is not None:
            y.add_(b)  # y is this function's own output buffer
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = _needed(ctx)
        grad_w = _weight_grad(grad_out, x, ctx.in_out) if need_w else None
        grad_b = _flat(grad_out).sum(0) if need_b else None
        return (*_dtensor_grads(ctx, grad_out @ w if need_x else None, grad_w, grad_b), None)


def _gathered_in_input_pass(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor | None:
    """The output grad a zero-bubble input pass all-gathered, for its weight pass (Megatron keeps it for the deferred
    weight grad too): only for the very grad it gathered, unchanged since (the input pass holds it, so no other
    tensor can live at its address); taken once."""
    kept = getattr(ctx, "gathered", None)
    ctx.gathered = None
    if kept is None:
        return None
    source, version, gathered = kept
    same = source.data_ptr() == grad_out.data_ptr() and source.shape == grad_out.shape
    return gathered if same and source.stride() == grad_out.stride() and grad_out._version == version else None


class RowLinearSequenceParallelFunction(torch.autograd.Function):
    """Sequence-parallel row linear as one node: ``y = reduce_scatter_seq(x_r W_r^T) + b`` on this rank's sequence
    shard. Backward all-gathers the output grad over the sequence; the bias grad (a partial sum over the sequence
    shards) is all-reduced asynchronously while the input- and weight-grad matmuls run. A zero-bubble schedule's
    input pass keeps the gathered grad for its weight pass, which then gathers nothing."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: DTensor, bias: DTensor | None, mesh: DeviceMesh, in_out: bool = False
    ) -> torch.Tensor:
        b = local_tensor(bias) if bias is not None else None
        x, w, b = _autocast_operands(x, matrix(local_tensor(weight), in_out), b)
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.bias, ctx.mesh, ctx.in_out = weight, bias, mesh, in_out
        y = _reduce_scatter(torch.nn.functional.linear(x, w), mesh, -2)  # [b, s, h]: s; flattened [tokens, h]
        if b is not None:
            y.add_(b)  # y is the reduce-scatter's fresh output
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = _needed(ctx)
        work = grad_b = None
        if need_b:
            grad_b = _flat(grad_out).sum(0)
            work = dist.all_reduce(grad_b, group=ctx.mesh.get_group(), async_op=True)
        grad_full = _gathered_in_input_pass(ctx, grad_out) if need_w and not need_x else None
        if grad_full is None and (need_x or need_w):
            grad_full = _all_gather(grad_out, ctx.mesh, -2)
        if need_x and not need_w and ctx.needs_input_grad[1]:  # a zero-bubble input pass: its weight pass comes next
            ctx.gathered = (grad_out, grad_out._version, grad_full)
        grad_x = grad_full @ w if need_x else None
        grad_w = _weight_grad(grad_full, x, ctx.in_out) if need_w else None
        if work is not None:
            work.wait()
        return (*_dtensor_grads(ctx, grad_x, grad_w, grad_b), None)
