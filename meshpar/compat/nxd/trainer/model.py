"""``neuronx_distributed.trainer.model``: ``NxDModel``, the module ``initialize_parallel_model`` returns: the model
(or its ``NxDPPModel``) with NxD's ``run_train`` / ``run_eval``, and module views over this rank's stages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class NxDModel(nn.Module):
    def __init__(self, module: nn.Module, nxd_config: dict[str, Any]) -> None:
        super().__init__()
        self.module = module
        self.nxd_config = nxd_config
        self.pp_enabled = nxd_config["pipeline_parallel_size"] > 1
        if not self.pp_enabled:
            self.train()

    def __repr__(self) -> str:
        return f"NxDModel({self.module!r})"

    def local_modules(self) -> list[nn.Module]:
        return self.module.local_stage_modules if self.pp_enabled else [self.module]

    def original_module(self) -> nn.Module:
        return self.module.original_torch_module if self.pp_enabled else self.module

    def run_train(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One forward and backward: the pipeline's ``run_train``, or the model's loss (its output) backpropagated."""
        if self.pp_enabled:
            return self.module.run_train(*args, **kwargs)
        loss = self.forward(*args, **kwargs)
        loss.backward()
        return loss

    def run_eval(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pp_enabled:
            raise RuntimeError("`run_eval` should be used only when pipeline parallel is enabled.")
        return self.module.run_eval(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # NxD's module views: a pipeline's are this rank's stages (NxDPPModel's local_* views), under the model's FQNs
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        if self.pp_enabled:
            yield from self.module.local_named_parameters(*args, **kwargs)
        else:
            yield from self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if self.pp_enabled:
            yield from self.module.local_named_buffers(*args, **kwargs)
        else:
            yield from self.module.named_buffers(*args, **kwargs)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        yield from self.module.local_named_children() if self.pp_enabled else self.module.named_children()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        if self.pp_enabled:
            yield from self.module.local_named_modules(*args, **kwargs)
        else:
            yield from self.module.named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.pp_enabled:
            return self.module.local_state_dict(*args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """A pipeline's stages take the keys they hold (a whole model's state dict loads on every pp rank)."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    @property
    def dtype(self) -> torch.dtype:
        return self.original_module().dtype

    @property
    def config(self) -> Any:
        return self.original_module().config

    @property
    def name_or_path(self) -> str:
        return self.original_module().name_or_path


__all__ = ["NxDModel"]
