"""``neuronx_distributed.utils.tensor_capture.api``: the five calls of NxD's tensor capture (see
:mod:`~.registry` for what is kept and how entries are named)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from meshpar.compat.nxd.utils.logger import get_logger
from meshpar.compat.nxd.utils.tensor_capture.model_modification import (
    find_available_modules,
    modify_model_for_tensor_capture,
    restore_model,
)
from meshpar.compat.nxd.utils.tensor_capture.registry import TensorRegistry

__all__ = [
    "disable_tensor_capture",
    "enable_tensor_capture",
    "get_available_modules",
    "get_captured_tensors_dict",
    "register_tensor",
]

_log = get_logger()


def enable_tensor_capture(
    model: nn.Module,
    modules_to_capture: list[str] | None = None,
    max_tensors: int | None = None,
    capture_inputs: bool = False,
) -> nn.Module:
    """Capture the outputs (and with ``capture_inputs`` the inputs) of ``modules_to_capture`` on each forward,
    and up to ``max_tensors`` tensors given to :func:`register_tensor`. Unknown module names raise ``ValueError``."""
    _log.info("tensor capture: enabling for modules %s", list(modules_to_capture or []))
    return modify_model_for_tensor_capture(model, modules_to_capture, max_tensors, capture_inputs)


def disable_tensor_capture(model: nn.Module) -> nn.Module:
    """Stop capturing, take the hooks off and forget what was captured."""
    restored = restore_model(model)
    TensorRegistry.get_instance().clear()
    return restored


def get_available_modules(model: nn.Module) -> list[str]:
    """The module names :func:`enable_tensor_capture` accepts for ``model``."""
    return find_available_modules(model)


def register_tensor(name: str, tensor: torch.Tensor) -> None:
    """Capture ``tensor`` under ``name`` from anywhere in a forward (kept as ``manual_<name>``; a no-op while
    capture is off)."""
    TensorRegistry.get_instance().register_tensor(name, tensor)


def get_captured_tensors_dict() -> OrderedDict[str, torch.Tensor]:
    """What was captured, by name: module inputs / outputs first, then the registered tensors."""
    return TensorRegistry.get_instance().get_captured_tensors_dict()
