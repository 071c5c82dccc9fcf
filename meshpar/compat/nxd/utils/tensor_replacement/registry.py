"""``neuronx_distributed.utils.tensor_replacement.registry``: the replacement tensors and masks for one forward.

NxD's ``RuntimeRegister`` is a class used as a namespace: ``module_superset`` names the modules whose outputs may be
replaced (in the order their tensors are passed), and ``register_runtime_args`` stores, per module, a detached copy
of the replacement tensor and its boolean mask for the duration of one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

__all__ = ["RuntimeRegister"]


class RuntimeRegister:
    _tr_runtime_list: ClassVar[dict[str, torch.Tensor]] = {}
    _tr_mask_list: ClassVar[dict[str, torch.Tensor]] = {}
    module_superset: ClassVar[list[str]] = []

    @classmethod
    def register_runtime_args(cls, tr_args: Sequence[torch.Tensor], mask_args: Sequence[torch.Tensor]) -> None:
        """One replacement tensor and one mask per module of ``module_superset``, in its order; what an earlier
        forward registered is dropped first."""
        expected = len(cls.module_superset)
        if len(tr_args) != expected or len(mask_args) != expected:
            raise ValueError(
                f"[TF:] Expected {expected} tf tensors & {expected} masks (one each per module of module_superset), "
                f"got {len(tr_args)} and {len(mask_args)}"
            )
        cls.clear_runtime_args()
        for name, tensor, mask in zip(cls.module_superset, tr_args, mask_args, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"[TF:] Tensor for '{name}' must be a torch.Tensor, got {type(tensor)}")
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"[TF:] Mask for '{name}' must be a torch.Tensor, got {type(mask)}")
            cls._tr_runtime_list[name] = tensor.detach().clone()
            cls._tr_mask_list[name] = mask.detach().clone()

    @classmethod
    def clear_runtime_args(cls) -> None:
        cls._tr_runtime_list = {}
        cls._tr_mask_list = {}
