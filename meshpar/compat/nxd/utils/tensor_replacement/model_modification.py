"""``neuronx_distributed.utils.tensor_replacement.model_modification``: teacher forcing of module outputs.

After ``modify_model_for_tensor_replacement(model)`` the model's forward takes, after its own positional arguments,
one replacement tensor per module of ``RuntimeRegister.module_superset`` and then one boolean mask per module; each
such module's output is ``torch.where(mask, replacement, output)``. A reference run's activations can so be forced
into a model under test, layer by layer, to find where two implementations part.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.utils.tensor_replacement.registry import RuntimeRegister

__all__ = ["modify_model_for_tensor_replacement", "patch_forward_with_additional_args"]


def patch_forward_with_additional_args(model: nn.Module, module_superset: Sequence[str]) -> nn.Module:
    """Make ``model.forward`` take ``2 * len(module_superset)`` trailing positional tensors (the replacements,
    then the masks), registered with :class:`RuntimeRegister` for the call and cleared after it."""
    original_forward = model.forward
    own_args = len([p for p in inspect.signature(original_forward).parameters.values() if p.name != "self"])
    count = len(module_superset)

    @functools.wraps(original_forward)
    def forward_with_replacements(self: nn.Module, *args: Any) -> Any:
        trailing = args[own_args:]
        if len(trailing) != 2 * count:
            raise ValueError(
                f"[Tensor replacement] modules: expected {2 * count} trailing replacement args "
                f"(tensors[{count}] + masks[{count}]), got {len(trailing)}."
            )
        RuntimeRegister.register_runtime_args(tr_args=list(trailing[:count]), mask_args=list(trailing[count:]))
        try:
            return original_forward(*args[:own_args])
        finally:
            RuntimeRegister.clear_runtime_args()  # the tensors are not held past the call

    model.forward = types.MethodType(forward_with_replacements, model)
    return model


def _replacing_hook(name: str) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        replacement = RuntimeRegister._tr_runtime_list.get(name)
        mask = RuntimeRegister._tr_mask_list.get(name)
        if replacement is None or mask is None:
            raise ValueError(
                f"tensor replacement: no replacement tensor and mask registered for {name!r} (got {replacement} and "
                f"{mask}); call the model with them as trailing arguments"
            )
        return torch.where(mask, replacement, output)

    return hook


def modify_model_for_tensor_replacement(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """Patch the forward (:func:`patch_forward_with_additional_args`) and hook each module of
    ``RuntimeRegister.module_superset``; returns the model and the hook handles by module name."""
    targets = list(RuntimeRegister.module_superset)
    modules = dict(model.named_modules())
    missing = [name for name in targets if name not in modules]
    if missing:  # their replacements would silently never apply
        raise ValueError(f"tensor replacement: the model has no modules named {missing}")
    model = patch_forward_with_additional_args(model, targets)
    handles = {name: modules[name].register_forward_hook(_replacing_hook(name)) for name in targets}
    return model, handles
