"""``neuronx_distributed.utils.tensor_capture.registry``: where captured tensors are kept.

NxD keeps them in one process-wide registry (``TensorRegistry.get_instance()``), configured by
``enable_tensor_capture`` and read by ``get_captured_tensors_dict``; this view keeps that shape because NxD code and
tests reach into it (``registry.model_info.module_tensors`` ...). Two kinds of entries:

- *module tensors*: the inputs / outputs of the modules being watched, keyed ``<module>.outputs[.i|.key]`` and
  ``<module>.inputs[.i|.kwargs.name]`` (or just ``<module>`` when registered under the module's own name);
- *manual tensors*: anything else a user registers, keyed ``manual_<name>`` (``manual_<name>_<n>`` for the n-th
  repeat), at most ``max_tensors`` of them (a traced graph needs a fixed number of outputs).

Every entry is a detached copy, so later in-place updates of the original do not change what was captured.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

import torch

__all__ = ["CapturedModelInfo", "TensorRegistry"]

_DEFAULT_MAX_TENSORS = 10  # what an unconfigured (or cleared) registry allows, as in NxD


class CapturedModelInfo:
    """What is watched (``modules_to_capture``, ``max_tensors``, ``capture_inputs``), the hook handles, and what was
    captured so far (``module_tensors`` and ``manual_tensors``, in arrival order)."""

    def __init__(self, modules_to_capture: list[str], max_tensors: int | None = None, capture_inputs: bool = False):
        self.modules_to_capture = modules_to_capture
        self.max_tensors = max_tensors
        self.capture_inputs = capture_inputs
        self.hooks: list[Any] = []
        self.module_tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.manual_tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.manual_tensors_keys: defaultdict[str, int] = defaultdict(int)  # repeats per manual name


class TensorRegistry:
    """The process's tensor-capture registry (``get_instance()``); off until configured with ``enabled=True``."""

    _instance: TensorRegistry | None = None

    @classmethod
    def get_instance(cls) -> TensorRegistry:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        self.enabled = False
        self.model_info = CapturedModelInfo([], _DEFAULT_MAX_TENSORS, False)

    def clear(self) -> None:
        """Forget the configuration and every captured tensor (``enabled`` is left as it is)."""
        self.model_info = CapturedModelInfo([], _DEFAULT_MAX_TENSORS, False)

    def configure(
        self,
        enabled: bool = False,
        modules: list[str] | None = None,
        max_tensors: int | None = None,
        capture_inputs: bool = False,
    ) -> None:
        """Start over with this configuration (what was captured before is dropped)."""
        self.enabled = enabled
        self.model_info = CapturedModelInfo(list(modules or []), max_tensors, capture_inputs)

    def _watched(self, name: Any) -> bool:
        if not isinstance(name, str):
            return False
        return any(name == module or name.startswith(f"{module}.") for module in self.model_info.modules_to_capture)

    def register_tensor(self, name: Any, tensor: torch.Tensor, neu_module: Any = None) -> None:
        """Keep a detached copy of ``tensor``: as a module tensor if ``name`` is a watched module or lies under one,
        else as a manual tensor (dropped once ``max_tensors`` are kept). Nothing happens while disabled.

        An ``lm_head`` output is kept without the vocabulary padding its layer (``neu_module``) added, and only if
        the layer gathers full logits (not sequence parallel): a captured tensor must be the model's real one."""
        if not self.enabled:
            return
        info = self.model_info
        if self._watched(name):
            captured = tensor.detach().clone()
            if "lm_head" in name and neu_module is not None:
                captured = _unpadded_logits(captured, neu_module)
            info.module_tensors[name] = captured
            return
        if info.max_tensors is not None and len(info.manual_tensors) >= info.max_tensors:
            return
        if isinstance(name, str):
            base = f"manual_{name}"
            repeat = info.manual_tensors_keys[base]
            key = base if base not in info.manual_tensors else f"{base}_{repeat}"
            info.manual_tensors_keys[base] = repeat + 1
        else:
            key = f"manual_tensor_{len(info.manual_tensors)}"
        info.manual_tensors[key] = tensor.detach().clone()

    def get_captured_tensors_dict(self) -> OrderedDict[str, torch.Tensor]:
        """Everything captured, in a fixed order: per watched module (in the order given) its inputs (when captured)
        then its outputs, each sorted by key; then the manual tensors in arrival order."""
        info = self.model_info
        result: OrderedDict[str, torch.Tensor] = OrderedDict()
        for module in info.modules_to_capture:
            if info.capture_inputs:
                for key in sorted(k for k in info.module_tensors if k.startswith(f"{module}.inputs")):
                    result[key] = info.module_tensors[key]
            for key in sorted(k for k in info.module_tensors if k == module or k.startswith(f"{module}.outputs")):
                result[key] = info.module_tensors[key]
        result.update(info.manual_tensors)
        return result

    def _add_moe_tensors_to_manual_registry(self, manual: dict[str, torch.Tensor]) -> None:
        """Fold the MoE layers' automatically registered expert indices (keys containing ``moe_auto``) into one
        stacked entry, ``auto_moe_stats.expert_index`` (one row per registration, in order)."""
        keys = [key for key in manual if "moe_auto" in key]
        if not keys:
            return
        manual["auto_moe_stats.expert_index"] = torch.stack([manual.pop(key) for key in keys])

    def get_module_tensors(self) -> OrderedDict[str, torch.Tensor]:
        return self.model_info.module_tensors

    def get_manual_tensors(self) -> OrderedDict[str, torch.Tensor]:
        self._add_moe_tensors_to_manual_registry(self.model_info.manual_tensors)
        return self.model_info.manual_tensors

    def get_manual_tensor_count(self) -> int:
        return len(self.model_info.manual_tensors)

    def get_monitored_tensor_count(self) -> int:
        return len(self.model_info.module_tensors)

    def get_total_tensor_count(self) -> int:
        return self.get_monitored_tensor_count() + self.get_manual_tensor_count()

    def remove_hooks(self) -> None:
        for handle in self.model_info.hooks:
            handle.remove()
        self.model_info.hooks = []


def _unpadded_logits(logits: torch.Tensor, layer: Any) -> torch.Tensor:
    if getattr(layer, "sequence_parallel_enabled", False):
        raise ValueError(
            "tensor capture of lm_head needs the layer's full logits: it is sequence parallel, so each rank holds "
            "only its slice; capture it with sequence parallelism off"
        )
    pad_size = getattr(layer, "pad_size", 0) or 0
    if getattr(layer, "pad", False) and pad_size > 0 and not getattr(layer, "keep_padded_output", False):
        return logits.narrow(-1, 0, layer.output_size - pad_size)
    return logits
