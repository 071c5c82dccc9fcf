"""Expert parallelism: routing tokens to the ranks that hold their experts, and their outputs back (dropless).

Experts are stacked ``[num_experts, ...]`` and sharded over the ``("ep", "tp")`` mesh
(:attr:`meshpar.parallel_dims.ParallelDims.expert_mesh`): ``num_experts / (ep * tp)`` whole experts per rank, in
blocks ordered ep-major, so rank ``(e, t)`` holds block ``b = e * tp + t``. The tp ranks of an ep rank see the same
tokens (tp does not split the batch); each of them sends only the routes whose expert lies in a block of its own tp
coordinate, so no route travels twice, and the partial outputs are summed over tp afterwards (one all-reduce, as the
tp-only layout does).

One MoE layer, per rank::

    routes (token, k) -> keep those for blocks of my tp coordinate -> sort by destination ep rank
    all-to-all: counts (host ints), then token rows with their routing weights       (dispatch)
    the experts run on what arrived (local expert ids, weights applied as the model applies them)
    all-to-all: the expert outputs back in the order they were sent                  (combine)
    index_add into [tokens, hidden]; the caller sums over tp

Backward runs the same all-to-alls with the counts swapped. A route's weight travels as one more column of its row
where the two share a dtype (one exchange each way for both; a weight of another dtype, which the column would
round, goes in an exchange of its own). Nothing is dropped by default: every route runs, however
many tokens an expert gets (Megatron-Core's and torchtitan's default). With a capacity factor
(:func:`drop_over_capacity`, Megatron-Core's ``moe_expert_capacity_factor``) each expert takes at most
``ceil(tokens * k / experts * factor)`` of the routes of one forward of one replica's tokens; the rest are dropped
before dispatch (their weight zero, their expert the sentinel ``num_experts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` (``send`` counts per rank, in rank order) exchanged over ``group``; the grads go back the same
    way with the counts swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], mesh: DeviceMesh) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` over the 1-D ``mesh``: ``send[r]`` rows to rank ``r``,
    ``recv[r]`` rows from it (dim 0 in rank order on both sides)."""
    return _AllToAll.apply(x, send, recv, mesh.get_group())


@dataclass
class Routes:
    """How the kept routes of one MoE layer left this rank (what :func:`combine` needs to bring them back)."""

    tokens: torch.Tensor  # the token each sent row came from, in send order
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    num_tokens: int


def dispatch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    num_experts: int,
    ep_mesh: DeviceMesh | None,
    tp_rank: int = 0,
    tp: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Routes]:
    """Send each route ``(token, k)`` whose expert lies in a block of this tp coordinate to the ep rank holding it
    (``ep_mesh`` ``None``: tp alone, the routes stay here).

    ``hidden`` is ``[tokens, hidden]``, ``top_k_index`` / ``top_k_weights`` ``[tokens, k]`` with global expert ids.
    Returns the received rows, their experts' local ids (``0 .. num_experts / (ep * tp) - 1``) and routing weights
    (one route per row), and the :class:`Routes` for :func:`combine`."""
    ep = ep_mesh.size() if ep_mesh is not None else 1
    local = num_experts // (ep * tp)
    k = top_k_index.shape[-1]
    flat_index = top_k_index.reshape(-1)
    block = flat_index // local
    # routes of this tp coordinate; a dropped route (expert id num_experts, drop_over_capacity) goes nowhere
    kept = torch.nonzero((block % tp == tp_rank) & (flat_index < num_experts)).squeeze(-1)
    # by destination rank, then expert: what each rank receives from one source is grouped by expert
    order = torch.argsort(flat_index[kept], stable=True)  # block-major: the destination's order, then the expert's
    kept = kept[order]
    tokens = kept // k
    local_ids, weights = flat_index[kept] % local, top_k_weights.reshape(-1)[kept]
    if ep_mesh is None:
        return hidden[tokens], local_ids, weights, Routes(tokens, [kept.numel()], [kept.numel()], hidden.shape[0])
    # rows per (destination rank, local expert): each receiver learns how many rows of each of its experts come
    # from each source, so the rows need no expert ids beside them (Megatron-Core's tokens per local expert)
    send_counts = torch.bincount(block[kept] // tp * local + local_ids, minlength=ep * local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep_mesh.get_group())
    per_rank = send_counts.view(ep, local).sum(-1), recv_counts.view(ep, local).sum(-1)
    send, recv = per_rank[0].tolist(), per_rank[1].tolist()  # the rows' sizes: a host sync, as in Megatron-Core
    local_index = torch.repeat_interleave(torch.arange(local, device=hidden.device).repeat(ep), recv_counts)
    rows, weights = _send_rows_and_weights(hidden[tokens], weights, send, recv, ep_mesh)
    return rows, local_index, weights, Routes(tokens, send, recv, hidden.shape[0])


def _send_rows_and_weights(
    rows: torch.Tensor, weights: torch.Tensor, send: list[int], recv: list[int], mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and their routing weights exchanged: in one all-to-all, the weight as a last column, where their
    dtypes match (exact); else in two, so that no weight is rounded to the rows' dtype."""
    if weights.dtype != rows.dtype:
        return all_to_all(rows, send, recv, mesh), all_to_all(weights.unsqueeze(-1), send, recv, mesh).squeeze(-1)
    both = all_to_all(torch.cat((rows, weights.unsqueeze(-1)), dim=-1), send, recv, mesh)
    # copies, not views: the received buffer is freed here instead of living on beside the rows
    return both[:, :-1].contiguous(), both[:, -1].clone()


def combine(expert_output: torch.Tensor, routes: Routes, ep_mesh: DeviceMesh | None) -> torch.Tensor:
    """The experts' (weighted) output rows back to the ranks their tokens came from, summed per token:
    ``[tokens, hidden]`` (zeros for tokens none of whose routes this tp coordinate handled)."""
    back = all_to_all(expert_output, routes.recv, routes.send, ep_mesh) if ep_mesh is not None else expert_output
    out = back.new_zeros((routes.num_tokens, *back.shape[1:]))
    return out.index_add(0, routes.tokens, back)


def experts_touched(output: torch.Tensor, parameters: list[torch.Tensor]) -> torch.Tensor:
    """``output`` made to depend on every expert parameter with a zero weight, so that experts that received no
    rows still get a (zero) grad: the dense model's stacked expert weights always get one, and an optimizer treats a
    zero grad (moments decay, weight decay applies) differently from a missing one."""
    touch = sum(p.reshape(-1)[:1].sum() for p in parameters) * 0.0
    return output + touch.to(output.dtype)


DROP_POLICIES = ("probs", "position")


def capacity_keep(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    factor: float,
    policy: str = "probs",
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which routes ``[tokens, k]`` Megatron-Core's token dropping keeps (a bool mask of their shape): each expert at
    most ``ceil(tokens * k / num_experts * factor)`` of those it got, the highest routing weights (``"probs"``) or
    the earliest tokens' (``"position"``), ties going to the earlier token. ``order`` (``[tokens]``, distinct) is each
    token's place in the dense model's token order where the rows arrive in another (sequence-parallel shards, cp
    chunks); ``None``: the rows' own order."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"unknown drop policy {policy!r}; one of {DROP_POLICIES}")
    if order is not None:  # decide in the dense order, answer in the rows' own
        perm = torch.argsort(order)
        keep = capacity_keep(top_k_index[perm], top_k_weights[perm], num_experts, factor, policy)
        return torch.empty_like(keep).index_copy(0, perm, keep)
    tokens, k = top_k_index.shape
    capacity = math.ceil(tokens * k / num_experts * factor)
    flat = top_k_index.reshape(-1)
    if policy == "probs":
        order = torch.argsort(top_k_weights.reshape(-1).detach(), descending=True, stable=True)
    else:  # routes are token-major: their flat order is the tokens' order
        order = torch.arange(flat.numel(), device=flat.device)
    order = order[torch.argsort(flat[order], stable=True)]  # by expert, each expert's routes in preference order
    counts = torch.bincount(flat, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return ((rank < capacity) & (flat < num_experts)).view_as(top_k_index)


def drop_over_capacity(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    factor: float,
    policy: str = "probs",
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core's token dropping (:func:`capacity_keep`): a dropped route gets the expert id ``num_experts``
    (routed nowhere) and weight 0. Kept routes keep their weights (no renormalisation, as Megatron-Core)."""
    keep = capacity_keep(top_k_index, top_k_weights, num_experts, factor, policy, order)
    return without_dropped(top_k_index, top_k_weights, keep, num_experts)


def without_dropped(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, keep: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes with those not in ``keep`` sent nowhere (expert id ``num_experts``, weight 0)."""
    index = torch.where(keep, top_k_index, num_experts)
    return index, top_k_weights * keep.to(top_k_weights.dtype)
