"""Optimizers for sharded models: local-shard stepping, optional ZeRO-1 over dp, fp32 master weights.

``DistributedOptimizer(model, torch.optim.AdamW, lr=...)`` wraps any torch optimizer. It steps on each parameter's
*local* tensor (the tp shard of a DTensor, or the plain tensor), so torch's fast ``foreach`` kernels run even when a
model mixes DTensor and plain parameters (torch rejects such mixed groups). With ``zero1=True`` each dp rank keeps
optimizer state for about ``1/dp`` of the parameters (whole tensors, balanced by size) and all-gathers the updated
parameters after the step (NxD's ``use_zero1_optimizer``); grads must already be averaged over dp. With
``master_weights=True`` low-precision parameters are updated through fp32 copies.

``state_dict()`` is keyed by the model's parameter FQNs, with tensor states as DTensors carrying the parameter's
placements, so :mod:`meshpar.checkpoint` saves and reshards it with DCP across any tp / pp / dp layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import DeviceMesh, DTensor
from meshpar.parallel_dims import get_parallel, is_initialized


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Greedy balance: biggest tensors first, each to the least-loaded rank."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(ranks), key=lambda r: load[r])
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


class DistributedOptimizer:
    def __init__(
        self,
        model: nn.Module | list[tuple[str, nn.Parameter]],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        *,
        zero1: bool = False,
        master_weights: bool = False,
        dp_mesh: DeviceMesh | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        named = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
        self.named_params = [(name, p) for name, p in named if p.requires_grad]
        if dp_mesh is None and is_initialized():
            dp_mesh = get_parallel().dp_mesh
        self.dp_mesh = dp_mesh
        self.zero1 = zero1 and dp_mesh is not None and dp_mesh.size() > 1
        dp, dp_rank = (dp_mesh.size(), dp_mesh.get_local_rank()) if self.zero1 else (1, 0)
        sizes = [local_tensor(p).numel() for _, p in self.named_params]
        self.owners = _assign_owners(sizes, dp) if self.zero1 else [0] * len(sizes)
        self.owned = [i for i, owner in enumerate(self.owners) if owner == dp_rank]
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
        self.optimizer = optimizer_cls([self._leaves[i] for i in self.owned], **optimizer_kwargs)

    # -- torch.optim.Optimizer surface -----------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, param in self.named_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i in self.owned:
            param = self.named_params[i][1]
            leaf = self._leaves[i]
            grad = None if param.grad is None else local_tensor(param.grad)
            leaf.grad = None if grad is None else (grad.float() if leaf.dtype != grad.dtype else grad)
        self.optimizer.step()
        for i in self.owned:
            if i in self._has_master:  # other leaves share the parameter's storage: the step already updated it
                local_tensor(self.named_params[i][1]).copy_(self._leaves[i])
            self._leaves[i].grad = None
        if self.zero1:
            self._broadcast_updated_params()

    def _broadcast_updated_params(self) -> None:
        """Every dp rank hands the parameters it owns to the others: one all-gather per dtype, each rank's owned
        tensors flattened into an equal-sized (zero-padded) segment, instead of one broadcast per owner."""
        group, dp, me = self.dp_mesh.get_group(), self.dp_mesh.size(), self.dp_mesh.get_local_rank()
        tensors = [local_tensor(p) for _, p in self.named_params]
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            by_owner = [
                [t for i, t in enumerate(tensors) if t.dtype == dtype and self.owners[i] == r] for r in range(dp)
            ]
            segment = max(sum(t.numel() for t in owned) for owned in by_owner)
            if segment == 0:
                continue
            mine = by_owner[me]
            send = torch.zeros(segment, dtype=dtype, device=tensors[0].device)
            if mine:
                torch.cat([t.reshape(-1) for t in mine], out=send[: sum(t.numel() for t in mine)])
            gathered = send.new_empty(dp * segment)
            dist.all_gather_into_tensor(gathered, send, group=group)
            for owner, owned in enumerate(by_owner):
                if owner == me:
                    continue
                offset = owner * segment
                for t in owned:
                    t.copy_(gathered[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

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
        if isinstance(param, DTensor) and value.dim() > 0 and value.shape == param._local_tensor.shape:
            return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)
        return value

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {fqn: {name: tensor}}, "param_groups": [...]}`` for the parameters this rank owns."""
        inner = self.optimizer.state_dict()
        state = {}
        for position, i in enumerate(self.owned):
            name, param = self.named_params[i]
            entry = {k: self._wrap_like(v, param) for k, v in inner["state"].get(position, {}).items()}
            if i in self._has_master:
                entry["master_weight"] = self._wrap_like(self._leaves[i], param)
            state[name] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner_state = {}
        for position, i in enumerate(self.owned):
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
