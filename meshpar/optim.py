"""Optimizers for sharded models: local-shard stepping, optional ZeRO-1 over dp, fp32 master weights.

``DistributedOptimizer(model, torch.optim.AdamW, lr=...)`` wraps any torch optimizer. It steps on each parameter's
*local* tensor (the tp shard of a DTensor, or the plain tensor), so torch's fast ``foreach`` kernels run even when a
model mixes DTensor and plain parameters (torch rejects such mixed groups). With ``zero1=True`` each dp rank keeps
optimizer state for about ``1/dp`` of the parameters (whole tensors, balanced by size) and all-gathers the updated
parameters after the step (NxD's ``use_zero1_optimizer``). Grads must then already be averaged over dp, unless
``reduce_scatter_grads=True``: the optimizer then reduce-scatters the raw grads itself, so each rank receives only the
averaged grads of what it owns (Megatron's distributed optimizer). A step then moves the bytes of one all-reduce
(reduce-scatter + all-gather) instead of 1.5 (all-reduce + all-gather). Under expert parallelism the expert weights
(different experts on different dp ranks) are owned within the expert-data-parallel group, the dp ranks holding the
same experts, as Megatron's distributed optimizer does; their grads are summed there and divided by dp, as
:class:`meshpar.data_parallel.DataParallelGrads` does. Under context parallelism the dense weights are owned over dp x
cp (every cp rank holds them, and a share of each grad). With ``master_weights=True`` low-precision parameters are
updated through fp32 copies.

``state_dict()`` is keyed by the model's original parameter FQNs (the stages' names, never a wrapper's prefixes),
with tensor states as DTensors carrying the parameter's placements, so :mod:`meshpar.checkpoint` saves and reshards
model and optimizer together with DCP across any tp / pp / dp layout, ZeRO-1 and FSDP included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import DeviceMesh, DTensor, dist_all_gather_single, dist_reduce_scatter_single, local_tensor
from meshpar._dp_checks import check_same_across_dp, holds_different_experts, refuse_dp_sharded
from meshpar._fqn import original_named_parameters
from meshpar.grad_clip import clip_grad_norm, partitioned_grad_norm, scale_to_max_norm
from meshpar.parallel_dims import ParallelDims


def _assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Greedy balance: biggest tensors first, each to the least-loaded rank."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(ranks), key=lambda r: load[r])
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


@dataclass
class _Partition:
    """Parameters replicated over one group, each owned by one of its ranks under ZeRO-1: the dense ones over dp, the
    expert weights over the expert-data-parallel group. ``layouts``: per dtype, the parameter indices each rank of
    the group owns and the length of one rank's segment (see :meth:`DistributedOptimizer._owner_layouts`)."""

    mesh: DeviceMesh
    indices: list[int]
    layouts: dict[torch.dtype, tuple[list[list[int]], int]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


class DistributedOptimizer:
    def __init__(
        self,
        model: nn.Module | list[tuple[str, nn.Parameter]],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        *,
        zero1: bool = False,
        reduce_scatter_grads: bool = False,
        reduce_dtype: torch.dtype | None = None,
        free_local_grads: bool = True,
        master_weights: bool = False,
        dp_mesh: DeviceMesh | None = None,
        dims: ParallelDims | None = None,
        param_groups: Sequence[dict[str, Any]] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if reduce_scatter_grads and not zero1:
            raise ValueError(
                "reduce_scatter_grads=True needs zero1=True: without ZeRO-1 every dp rank steps every parameter and "
                "needs all averaged grads (all-reduce them with meshpar.data_parallel.allreduce_gradients)"
            )
        # original FQNs (not a wrapper's ``module.`` / ``pipeline.chunks.0.stage.``): the state reshards by them
        named = original_named_parameters(model) if isinstance(model, nn.Module) else list(model)
        self.named_params = [(name, p) for name, p in named if p.requires_grad]
        # the model's mesh (also what clip_grad_norm sums over): given, or the parallel model's own
        dims = dims if dims is not None else getattr(model, "dims", None)
        if dims is None and dp_mesh is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise TypeError(
                f"DistributedOptimizer over {type(model).__name__} in a job of {dist.get_world_size()} processes: "
                "pass dims= (the ParallelDims the model is sharded on) or dp_mesh=; a parallelized model carries "
                "its own (model.dims)"
            )
        self.dims = dims
        if dp_mesh is None and dims is not None:
            dp_mesh = dims.dp_mesh
        self.dp_mesh = dp_mesh
        # what a dense weight is replicated over: dp, and cp with it (each cp rank holds a share of every grad)
        self._replica_mesh = dims.grad_mesh if dims is not None and dims.cp > 1 else dp_mesh
        self.zero1 = zero1 and self._replica_mesh is not None and self._replica_mesh.size() > 1
        self.reduce_scatter_grads = reduce_scatter_grads and self.zero1
        self.reduce_dtype = reduce_dtype
        self.free_local_grads = free_local_grads
        sizes = [local_tensor(p).numel() for _, p in self.named_params]
        self.owners = [0] * len(sizes)  # each parameter's owner: a rank of its partition's group
        self._partitions = self._partition() if self.zero1 else []
        for part in self._partitions:
            owners = _assign_owners([sizes[i] for i in part.indices], part.mesh.size())
            for i, owner in zip(part.indices, owners, strict=True):
                self.owners[i] = owner
            part.layouts = self._owner_layouts(part)
        ranks = {i: part.rank for part in self._partitions for i in part.indices}
        self.owned = [i for i, owner in enumerate(self.owners) if owner == ranks.get(i, 0)]
        self._reduced: dict[int, torch.Tensor] | None = None  # owned index -> averaged grad (reduce_scatter_grads)
        self.master_weights = master_weights
        self._leaves: dict[int, torch.Tensor] = {}
        self._has_master: set[int] = set()  # leaves that are fp32 copies, not views of the parameter's storage
        for i in self.owned:
            local = local_tensor(self.named_params[i][1]).detach()
            if master_weights and local.dtype != torch.float32:
                self._leaves[i] = local.float().clone()
                self._has_master.add(i)
            else:
                self._leaves[i] = local
        group_of, options = self._group_of(param_groups)
        # the inner optimizer's parameter order (its state_dict numbering): group by group, every parameter, each
        # one this rank does not own as an empty tensor (its share of it: nothing), so the inner groups pair one to
        # one with the caller's, as torch_xla's ZeRO-1 shards do (code that zips the two stays right); an empty
        # tensor never has a grad, so no optimizer steps it or gives it state
        members = [[i for i, group in enumerate(group_of) if group == g] for g in range(len(options))]
        self._inner_order = [i for indices in members for i in indices]
        inner_groups = [
            {"params": [self._leaf_or_nothing(i) for i in indices], **group_options}
            for indices, group_options in zip(members, options, strict=True)
        ]
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)

    def _leaf_or_nothing(self, i: int) -> torch.Tensor:
        """What the inner optimizer steps for parameter ``i``: this rank's leaf, or an empty tensor where another
        rank owns it."""
        if i in self._leaves:
            return self._leaves[i]
        local = local_tensor(self.named_params[i][1])
        return torch.empty(0, dtype=local.dtype, device=local.device)

    def _group_of(self, param_groups: Sequence[dict[str, Any]] | None) -> tuple[list[int], list[dict[str, Any]]]:
        """Each parameter's group index and each group's options (torch's param-group format: ``params`` holds the
        model's parameter objects, every other key overrides the optimizer's keyword for that group). Without
        groups: one group of everything. A parameter in no group, in two, or not in the model is refused."""
        if param_groups is None:
            return [0] * len(self.named_params), [{}]
        index = {id(p): i for i, (_, p) in enumerate(self.named_params)}
        group_of = [-1] * len(self.named_params)
        options = []
        for g, group in enumerate(param_groups):
            options.append({k: v for k, v in group.items() if k != "params"})
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                i = index.get(id(param))
                if i is None:
                    raise ValueError(f"param_groups[{g}] holds a parameter the model does not")
                if group_of[i] != -1:
                    raise ValueError(f"{self.named_params[i][0]} is in param_groups {group_of[i]} and {g}")
                group_of[i] = g
        missing = [self.named_params[i][0] for i, g in enumerate(group_of) if g == -1]
        if missing:
            raise ValueError(f"parameters in no param group: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return group_of, options

    def _partition(self) -> list[_Partition]:
        """ZeRO-1's partitions: the dense parameters over dp (and cp: under context parallelism the reduce-scatter
        also sums the cp ranks' shares of the grads); expert weights (sharded over ep, so dp ranks hold different
        experts under one name) over the expert-data-parallel group, the dp ranks holding the same ones.
        Each partition's ranks must list the same parameters (checked once; its collectives pair their segments);
        dp-sharded (FSDP2) parameters are refused."""
        refuse_dp_sharded([p for _, p in self.named_params], "DistributedOptimizer(zero1=True)")
        # without dims, whether ep is on is unknown: a marked weight then needs the expert-data-parallel group
        expert_parallel = self.dims is None or self.dims.ep > 1
        experts = [i for i, (_, p) in enumerate(self.named_params) if holds_different_experts(p, expert_parallel)]
        expert_mesh = self.dims.expert_dp_mesh if self.dims is not None else None
        if experts and expert_mesh is None:
            raise ValueError(
                f"DistributedOptimizer(zero1=True): {self.named_params[experts[0]][0]} is sharded over ep, but the "
                "optimizer was given no mesh with an expert-data-parallel group: pass dims= (the model's ParallelDims)"
            )
        dense = [i for i in range(len(self.named_params)) if i not in set(experts)]
        parts = [_Partition(self._replica_mesh, dense)] + ([_Partition(expert_mesh, experts)] if experts else [])
        for part in parts:
            check_same_across_dp(
                [
                    (self.named_params[i][0], tuple(local_tensor(self.named_params[i][1]).shape), str(p.dtype))
                    for i in part.indices
                    for p in [self.named_params[i][1]]
                ],
                part.mesh.get_group(),
                part.mesh.size(),
                lambda lay: f"{len(lay)} tensors, {sum(math.prod(shape) for _, shape, _ in lay)} elements",
                "their ZeRO-1 owner layouts",
            )
        return parts

    def _owner_layouts(self, part: _Partition) -> dict[torch.dtype, tuple[list[list[int]], int]]:
        """Per dtype: the parameter indices of ``part`` each rank of its group owns and the length of one rank's
        segment (the largest owner's total plus one has-a-grad flag per tensor, so every segment of a flat
        ``ranks * segment`` buffer has the same size). The reduce-scatter of the grads and the all-gather of the
        updated parameters share this layout."""
        tensors = {i: local_tensor(self.named_params[i][1]) for i in part.indices}
        layouts = {}
        for dtype in sorted({t.dtype for t in tensors.values()}, key=str):
            by_owner = [
                [i for i, t in tensors.items() if t.dtype == dtype and self.owners[i] == r]
                for r in range(part.mesh.size())
            ]
            segment = max(sum(tensors[i].numel() for i in owned) + len(owned) for owned in by_owner)
            if segment:
                layouts[dtype] = (by_owner, segment)
        return layouts

    def _spans(self, by_owner: list[list[int]], segment: int) -> Iterator[tuple[int, int, slice]]:
        """``(owner, parameter index, slice of the flat dp * segment buffer)`` for every tensor of one dtype layout."""
        for owner, i, span, _ in self._spans_and_flags(by_owner, segment):
            yield owner, i, span

    def _spans_and_flags(self, by_owner: list[list[int]], segment: int) -> Iterator[tuple[int, int, slice, int]]:
        """:meth:`_spans` with the index of each tensor's has-a-grad flag (after its owner's tensors)."""
        for owner, indices in enumerate(by_owner):
            offset = owner * segment
            flag = offset + sum(local_tensor(self.named_params[i][1]).numel() for i in indices)
            for j, i in enumerate(indices):
                numel = local_tensor(self.named_params[i][1]).numel()
                yield owner, i, slice(offset, offset + numel), flag + j
                offset += numel

    # -- torch.optim.Optimizer surface -----------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = None
        for _, param in self.named_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """``reduce_scatter_grads``: average the grads over dp, each rank receiving only the parameters it owns.

        One reduce-scatter per dtype over a flat buffer laid out by owner, with one has-a-grad flag per tensor: a grad
        missing on some ranks counts as zeros in the mean, and a parameter no rank has a grad for gets none (the step
        skips it, as the dense step does, instead of decaying it with a zero grad). The flags are read back (a device
        sync) only on an owner that lacks some of its grads itself. The averaged grads are kept by the optimizer and
        every ``param.grad`` is freed: the local, un-averaged grads are no longer what the step uses (with
        ``free_local_grads=False`` they stay until the caller's ``zero_grad``, as torch_xla's ZeRO-1 leaves them).
        Called by :meth:`step` and :meth:`clip_grad_norm` (once per step); a no-op otherwise."""
        if not self.reduce_scatter_grads or self._reduced is not None:
            return
        dp = self.dims.dp if self.dims is not None else self.dp_mesh.size()  # each group's sum is divided by dp
        params = [p for _, p in self.named_params]
        self._reduced = {}
        for part, dtype, (by_owner, segment) in self._layouts():
            ranks = part.mesh.size()
            send = torch.zeros(ranks * segment, dtype=self.reduce_dtype or dtype, device=local_tensor(params[0]).device)
            for _, i, span, flag in self._spans_and_flags(by_owner, segment):
                if params[i].grad is not None:
                    send[span].copy_(local_tensor(params[i].grad).reshape(-1))
                    send[flag] = 1
            send.div_(dp)  # pre-divide: the sum of dp means stays in range in low precision
            received = send.new_empty(segment)
            dist_reduce_scatter_single(received, send, group=part.mesh.get_group())
            mine = part.rank * segment  # where this rank's segment starts in the flat layout
            lacking: dict[int, int] = {}  # owned parameters without a local grad -> their flag in received
            for owner, i, span, flag in self._spans_and_flags(by_owner, segment):
                if owner == part.rank:
                    local = local_tensor(params[i])
                    self._reduced[i] = received[span.start - mine : span.stop - mine].view(local.shape)
                    if params[i].grad is None:
                        lacking[i] = flag - mine
            if lacking:
                for i, flag in zip(lacking, received[list(lacking.values())].tolist(), strict=True):
                    if flag == 0:
                        del self._reduced[i]
        if self.free_local_grads:
            for param in params:
                param.grad = None

    def _layouts(self) -> Iterator[tuple[_Partition, torch.dtype, tuple[list[list[int]], int]]]:
        """Every partition's owner layout per dtype, in one order on every rank."""
        for part in self._partitions:
            for dtype, layout in part.layouts.items():
                yield part, dtype, layout

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the grads so that their global norm (over tp, pp and dp, as on one device) is at most ``max_norm``;
        returns the norm before clipping. With ``reduce_scatter_grads`` the norm is taken over the reduced grads each
        rank owns (one scalar all-reduce over all ranks); otherwise this is :func:`meshpar.clip_grad_norm` over the
        parameters."""
        if not self.reduce_scatter_grads:
            return clip_grad_norm([p for _, p in self.named_params], max_norm, norm_type, dims=self.dims)
        self.reduce_grads()
        owned = [(self.named_params[i][1], grad) for i, grad in self._reduced.items()]
        norm = partitioned_grad_norm(owned, norm_type, dims=self.dims)
        scale_to_max_norm(list(self._reduced.values()), norm, max_norm)
        return norm

    def _grad_for(self, i: int) -> torch.Tensor | None:
        if self._reduced is not None:
            return self._reduced.get(i)
        grad = self.named_params[i][1].grad
        return None if grad is None else local_tensor(grad)

    @torch.no_grad()
    def step(self) -> None:
        self.reduce_grads()
        for i in self.owned:
            leaf = self._leaves[i]
            grad = self._grad_for(i)
            leaf.grad = None if grad is None else (grad.to(leaf.dtype) if leaf.dtype != grad.dtype else grad)
        self.optimizer.step()
        for i in self._has_master:  # other leaves share the parameter's storage: the step already updated it
            local_tensor(self.named_params[i][1]).copy_(self._leaves[i])
        self.optimizer.zero_grad(set_to_none=True)  # the leaves' grads (torch_xla's order: step, then zero_grad)
        self._reduced = None
        if self.zero1:
            self._gather_updated_params()

    def _gather_updated_params(self) -> None:
        """Every dp rank hands the parameters it owns to the others: one all-gather per dtype over the owner layout,
        instead of one broadcast per owner."""
        tensors = [local_tensor(p) for _, p in self.named_params]
        for part, dtype, (by_owner, segment) in self._layouts():
            me = part.rank
            send = torch.zeros(segment, dtype=dtype, device=tensors[0].device)
            mine = [tensors[i] for i in by_owner[me]]
            if mine:
                torch.cat([t.reshape(-1) for t in mine], out=send[: sum(t.numel() for t in mine)])
            gathered = send.new_empty(part.mesh.size() * segment)
            dist_all_gather_single(gathered, send, group=part.mesh.get_group())
            for owner, i, span in self._spans(by_owner, segment):
                if owner != me:
                    tensors[i].copy_(gathered[span].view_as(tensors[i]))

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and fp32 master copies) held by this rank."""
        total = sum(
            v.numel() * v.element_size()
            for state in self.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )
        return total + sum(self._leaves[i].numel() * self._leaves[i].element_size() for i in self._has_master)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the inner optimizer's state (a zero-lr step on zero grads) so a checkpoint can be loaded into it."""
        if self.optimizer.state:
            return
        saved = [(group["lr"], group.get("weight_decay", 0.0)) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        for leaf in self._leaves.values():
            leaf.grad = torch.zeros_like(leaf)
        self.optimizer.step()
        for leaf in self._leaves.values():
            leaf.grad = None
        for group, (lr, decay) in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
            if "weight_decay" in group:
                group["weight_decay"] = decay

    # -- FQN-keyed state for DCP -------------------------------------------------------------------------------
    def _wrap_like(self, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor) and value.dim() > 0 and value.shape == local_tensor(param).shape:
            # the parameter's own global shape: from_local would guess it from the local shape (wrong when uneven)
            return DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        return value

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {fqn: {name: tensor}}, "param_groups": [...]}`` for the parameters this rank owns."""
        inner = self.optimizer.state_dict()
        state = {}
        for position, i in enumerate(self._inner_order):
            if i not in self._leaves:
                continue  # another rank owns it
            name, param = self.named_params[i]
            entry = {k: self._wrap_like(v, param) for k, v in inner["state"].get(position, {}).items()}
            if i in self._has_master:
                entry["master_weight"] = self._wrap_like(self._leaves[i], param)
            state[name] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner_state = {}
        for position, i in enumerate(self._inner_order):
            if i not in self._leaves:
                continue  # another rank owns it
            name, _ = self.named_params[i]
            if name not in state_dict["state"]:
                raise KeyError(f"optimizer state for parameter {name!r} is missing from the checkpoint")
            entry = dict(state_dict["state"][name])
            master = entry.pop("master_weight", None)
            if master is not None:
                self._leaves[i].copy_(local_tensor(master))
            inner_state[position] = {k: local_tensor(v) for k, v in entry.items()}
        current = self.optimizer.state_dict()
        groups = [
            {**saved, "params": group["params"]}
            for saved, group in zip(state_dict["param_groups"], current["param_groups"], strict=True)
        ]
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": groups})
