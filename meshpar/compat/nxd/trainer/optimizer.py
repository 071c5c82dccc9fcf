"""``neuronx_distributed.trainer.optimizer``: ``NxDOptimizer``, the optimizer ``initialize_parallel_optimizer``
returns. Its ``step`` does what NxD's does before stepping: sums the sequence-parallel grads over tp (with
``sequence_parallel`` in the config), averages the grads over dp in buckets (an expert-parallel weight's over the
ranks holding the same experts, divided by dp, as NxD does) and clips them to ``max_grad_norm``
over the whole model (``grad_norm`` keeps the norm); a ZeRO-1 optimizer does its own reduction and clipping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshpar._dp_checks import is_expert_parallel
from meshpar.compat.nxd.parallel_layers import grads
from meshpar.parallel_dims import get_parallel


class NxDOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, nxd_config: dict[str, Any]) -> None:
        # torch.optim.Optimizer.__init__ is not called: every attribute it would set reads the wrapped optimizer
        self.optimizer = optimizer
        self.nxd_config = nxd_config
        self._grad_norm: torch.Tensor | None = None
        self.params = [p for group in self.param_groups for p in group["params"]]

    def __repr__(self) -> str:
        return f"NxDOptimizer({self.optimizer!r})"

    @property
    def grad_norm(self) -> torch.Tensor | None:
        return self._grad_norm

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "nxd_config": self.nxd_config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The dense parameters' grads and the expert-parallel ones' (``main_grad`` where a parameter has no grad)."""
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for param in self.params:
            grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
            if grad is not None:
                (experts if is_expert_parallel(param) else dense).append(grad.data)
        return dense, experts

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        grads.allreduce_context_parallel_gradients(self)
        if self.nxd_config["sequence_parallel"]:
            grads.allreduce_sequence_parallel_gradients(self)
        config = self.nxd_config["optimizer_config"]
        if not config["zero_one_enabled"]:
            dense, experts = self._gradients()
            grads.bucket_allreduce_gradients(dense + experts)  # over edp (all of dp without ep), / dp
            if get_parallel().ep > 1:  # a dense grad's mean is over all of dp: its ep groups too
                grads.bucket_allreduce_gradients(dense, reduce_over_ep_group=True)
            if config["grad_clipping"]:
                self._grad_norm = grads.clip_grad_norm(self.params, config["max_grad_norm"])
        result = self.optimizer.step(closure=closure)
        if config["zero_one_enabled"]:
            self._grad_norm = self.optimizer.grad_norm
        return result


__all__ = ["NxDOptimizer"]
