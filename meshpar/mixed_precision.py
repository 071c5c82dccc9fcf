"""Mixed precision pieces that need the mesh.

- bf16 training: keep parameters in bf16, let :class:`meshpar.DistributedOptimizer` hold fp32 master weights
  (``master_weights=True``) and average grads over dp in fp32 (``allreduce_gradients(reduce_dtype=torch.float32)``).
- fp16 training: :class:`GradScaler` scales the loss dynamically; whether any grad overflowed is agreed over the whole
  world (all tp, pp and dp ranks), so every rank skips or takes the same step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshpar._compat import local_tensor


class GradScaler:
    """Dynamic loss scaling with a world-wide inf/nan check (Megatron's ``DynamicGradScaler``)."""

    def __init__(
        self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
        growth_interval: int = 1000, min_scale: float = 1.0,
    ) -> None:  # fmt: skip
        self.scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self._good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(self, parameters: Iterable[torch.Tensor]) -> bool:
        """Divide grads by the scale; returns True when every rank's grads are finite (agreed on the parameters'
        device, where the process group's backend communicates)."""
        parameters = list(parameters)
        device = local_tensor(parameters[0]).device if parameters else torch.device("cpu")
        found = torch.zeros(1, device=device)
        for param in parameters:
            if param.grad is None:
                continue
            grad = local_tensor(param.grad)
            grad.mul_(1.0 / self.scale)
            if not torch.isfinite(grad).all():
                found.fill_(1.0)
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() == 0)

    def update(self, finite: bool) -> None:
        if finite:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
        else:
            self._good_steps = 0
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)

    def step(self, optimizer: object, parameters: Iterable[torch.Tensor]) -> bool:
        """Unscale, agree on overflow, step only if finite, update the scale. Returns whether the step was taken."""
        finite = self.unscale_and_check(parameters)
        if finite:
            optimizer.step()
        self.update(finite)
        return finite
