"""``apex.transformer.amp.grad_scaler``: torch's grad scaler whose inf / NaN check spans the model-parallel group.

A tp or pp rank that found an inf in its grads makes every rank of its model-parallel group skip the optimizer step,
so the shards of one model never diverge. Built on ``torch.amp.GradScaler`` for the process's device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshpar.parallel_dims import get_parallel


class GradScaler(torch.amp.GradScaler):
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        device = get_parallel().device.type if dist.is_initialized() else "cuda"
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def _unscale_grads_(self, optimizer: Any, *args: Any) -> Any:
        if getattr(optimizer, "_custom_amp_unscale_grads", False):
            return optimizer.unscale_grads(*args)
        return super()._unscale_grads_(optimizer, *args)

    def _maybe_opt_step(self, optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        found_inf = torch.tensor([found], dtype=torch.float32, device=get_parallel().device)
        _max_over_model_parallel(found_inf)
        return optimizer.step(*args, **kwargs) if found_inf.item() == 0 else None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's update, with each device's found-inf first maxed over the model-parallel group."""
        if self._enabled and new_scale is None and getattr(self, "_per_optimizer_states", None):
            for state in self._per_optimizer_states.values():
                for found in state["found_inf_per_device"].values():
                    _max_over_model_parallel(found)
        super().update(new_scale)


def _max_over_model_parallel(value: torch.Tensor) -> None:
    dims = get_parallel()
    for dim in ("tp", "pp"):
        if getattr(dims, dim) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=getattr(dims, f"{dim}_mesh").get_group())
