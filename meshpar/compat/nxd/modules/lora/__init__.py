"""``neuronx_distributed.modules.lora``: low-rank adapters (LoRA) for fine-tuning NxD models: :class:`LoraConfig`,
:class:`LoraModel` and ``get_lora_model`` (which also puts the adapters inside an ``NxDModel``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshpar.compat.nxd.modules.lora.config import LoraConfig
from meshpar.compat.nxd.modules.lora.model import LoraModel


def get_lora_model(model: nn.Module, lora_config: LoraConfig | None) -> Any:
    """``model`` with adapters: a ``LoraModel`` around it, or around the module an ``NxDModel`` holds (the
    ``NxDModel`` returned). No config: ``model`` as it is."""
    if lora_config is None:
        return model
    from meshpar.compat.nxd.trainer.model import NxDModel

    if isinstance(model, NxDModel):
        model.module = LoraModel(model.module, lora_config)
        return model
    return LoraModel(model, lora_config)


__all__ = ["LoraConfig", "LoraModel", "get_lora_model"]
