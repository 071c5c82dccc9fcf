"""``neuronx_distributed.utils.tensor_capture.model_modification``: watching modules with forward hooks.

``modify_model_for_tensor_capture`` puts a forward hook on each watched module that hands its inputs (optionally)
and outputs to the :class:`~.registry.TensorRegistry`, flattening what a module returns into named tensors: tuple
items by index, dict entries and dataclass / object attributes by name. ``restore_model`` takes the hooks off;
``find_available_modules`` lists the names that can be watched.
``modify_hf_eager_model_for_tensor_capture`` is NxD's variant for an HF model run eagerly: each captured tensor is
written to a file per forward call instead of kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.utils.logger import get_logger
from meshpar.compat.nxd.utils.tensor_capture.registry import TensorRegistry

__all__ = [
    "find_available_modules",
    "modify_hf_eager_model_for_tensor_capture",
    "modify_model_for_tensor_capture",
    "restore_model",
]

_log = get_logger()


def _named_tensors(prefix: str, obj: Any, sep: str = ".") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors inside ``obj`` with their names under ``prefix``: a tensor as ``prefix``, tuple items as
    ``prefix.i`` (recursively), dict entries as ``prefix.key`` (recursively), and the public non-callable tensor
    attributes of any other object (a dataclass, an HF ``ModelOutput``) as ``prefix.attr``. Lists and other values
    carry nothing (as in NxD)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, tuple):
        for index, item in enumerate(obj):
            yield from _named_tensors(f"{prefix}{sep}{index}", item, sep)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_tensors(f"{prefix}{sep}{key}", value, sep)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for attr in dir(obj):
            if attr.startswith("_"):
                continue
            value = getattr(obj, attr)
            if isinstance(value, torch.Tensor):
                yield f"{prefix}{sep}{attr}", value


def _capture_hook(module_name: str, capture_inputs: bool) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        registry = TensorRegistry.get_instance()
        captured = []
        if capture_inputs:
            if args:
                captured += _named_tensors(f"{module_name}.inputs", args)
            if kwargs:
                captured += _named_tensors(f"{module_name}.inputs.kwargs", kwargs)
        captured += _named_tensors(f"{module_name}.outputs", output)
        for name, tensor in captured:
            registry.register_tensor(name, tensor, module)

    return hook


def _check_watchable(model: nn.Module, modules: list[str], strip_model_prefix: bool = False) -> None:
    available = set(find_available_modules(model))
    if strip_model_prefix:
        available = {name.removeprefix("model.") for name in available}
    missing = [name for name in modules if name not in available]
    if missing:
        raise ValueError(f"tensor capture: the model has no modules named {missing}")


def modify_model_for_tensor_capture(
    model: nn.Module,
    modules_to_capture: list[str] | None = None,
    max_tensors: int | None = None,
    capture_inputs: bool = False,
) -> nn.Module:
    """Watch ``modules_to_capture`` (module FQNs; an unknown one raises ``ValueError`` before anything changes):
    the registry is configured afresh and enabled, and each module gets a capture hook. Returns ``model`` itself."""
    modules = list(modules_to_capture or [])
    _check_watchable(model, modules)
    registry = TensorRegistry.get_instance()
    registry.configure(enabled=True, modules=modules, max_tensors=max_tensors, capture_inputs=capture_inputs)
    for name, module in model.named_modules():
        if name in modules:
            handle = module.register_forward_hook(_capture_hook(name, capture_inputs), with_kwargs=True)
            registry.model_info.hooks.append(handle)
            _log.info("tensor capture: watching %s (%s)", name, type(module).__name__)
    return model


def modify_hf_eager_model_for_tensor_capture(
    model: nn.Module,
    modules_to_capture: list[str] | None = None,
    tensor_capture_save_dir: str = "",
    capture_inputs: bool = False,
) -> tuple[nn.Module, list[Any], Callable[..., Any]]:
    """Watch ``modules_to_capture`` of an HF model run eagerly (names may leave out the leading ``model.``): each
    captured tensor is saved, on the CPU, to ``captured_tensors_<phase>_step_<n>_module_<name>.pt`` in
    ``tensor_capture_save_dir``, where ``n`` counts the model's forward calls from 1 and the phase is ``cte``
    (context encoding) for the first call and ``tkg`` (token generation) after. Returns the model (its ``forward``
    wrapped to count calls), the hook handles, and the original ``forward`` to put back."""
    modules = list(modules_to_capture or [])
    _check_watchable(model, modules, strip_model_prefix=True)
    os.makedirs(tensor_capture_save_dir, exist_ok=True)
    original_forward = model.forward
    step = {"n": 1}

    def counting_forward(*args: Any, **kwargs: Any) -> Any:
        output = original_forward(*args, **kwargs)
        step["n"] += 1
        return output

    model.forward = counting_forward

    def saving_hook(module_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            captured = []
            if capture_inputs:
                if args:
                    captured += _named_tensors(f"{module_name}_inputs", args, sep="_")
                if kwargs:
                    captured += _named_tensors(f"{module_name}_inputs_kwargs", kwargs, sep="_")
            captured += _named_tensors(f"{module_name}_output", output, sep="_")
            phase = "cte" if step["n"] == 1 else "tkg"
            for name, tensor in captured:
                path = os.path.join(
                    tensor_capture_save_dir, f"captured_tensors_{phase}_step_{step['n']}_module_{name}.pt"
                )
                torch.save(tensor.detach().cpu(), path)
                _log.info("tensor capture: saved %s to %s", name, os.path.abspath(path))

        return hook

    handles = []
    for name, module in model.named_modules():
        short = name.removeprefix("model.")
        if short in modules:
            handles.append(module.register_forward_hook(saving_hook(short), with_kwargs=True))
    return model, handles, original_forward


def restore_model(model: nn.Module) -> nn.Module:
    """Take the capture hooks off and stop capturing; what was captured stays readable. Returns ``model``."""
    registry = TensorRegistry.get_instance()
    registry.remove_hooks()
    registry.enabled = False
    return model


def find_available_modules(model: nn.Module, prefix: str = "") -> list[str]:
    """Every submodule's name (depth first, each before its children), under ``prefix``."""
    names = []
    for name, child in model.named_children():
        full = f"{prefix}.{name}" if prefix else name
        names.append(full)
        names.extend(find_available_modules(child, full))
    return names
