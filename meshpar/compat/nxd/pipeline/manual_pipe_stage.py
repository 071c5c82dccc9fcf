"""``neuronx_distributed.pipeline.manual_pipe_stage``: a pipeline stage made of a slice of a model given as a list of
layers (``NxDPPModel(layers, manual_pp_partition=True)``), NxD's even partition and its weight-sharing marks.

Weights shared between layers placed on different stages (``mark_weight_sharing``, e.g. a tied embedding and LM
head) are kept one weight by ``NxDPPModel``: the first stage's values are copied to the others when it is built, and
after each ``run_train`` the stages' grads of it are summed (:func:`shared_weight_groups` says which layers share
what where). Layers on one stage share the tensor itself; marking two different tensors there is refused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from meshpar.compat.nxd.pipeline.partition import TooFewLayersError

WEIGHT_SHARING_ATTR_NAME = "weight_sharing"


class PipelineStageModule(nn.Module):
    """The layers of ``layers`` that ``partition_fn(layers, num_stages)`` (default: even) puts on ``stage_index``,
    run in order."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        num_stages: int,
        stage_index: int,
        partition_fn: Callable[[Sequence[nn.Module], int], dict[Any, int]] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(layers, (list, tuple)):
            raise TypeError("layers must be a list or tuple")
        self.num_stages, self.stage_index, self.partition_fn = num_stages, stage_index, partition_fn
        modules, shared = self._partition(layers, num_stages, stage_index, partition_fn)
        self.stage_modules = nn.ModuleList(modules)
        self.shared_weights_on_pp_stages = shared

    def forward(self, x: Any) -> Any:
        for module in self.stage_modules:
            x = module(x)
        return x

    @staticmethod
    def _partition_evenly(layers: Sequence[nn.Module], num_stages: int) -> dict[Any, int]:
        """``len(layers) // num_stages`` layers per stage, the remainder on the last."""
        size = len(layers) // num_stages
        if size == 0:
            raise TooFewLayersError(f"{len(layers)} layers cannot fill {num_stages} pipeline stages")
        return {layer: min(i // size, num_stages - 1) for i, layer in enumerate(layers)}

    @staticmethod
    def _partition(
        layers: Sequence[nn.Module],
        num_stages: int,
        stage_idx: int,
        partition_fn: Callable[[Sequence[nn.Module], int], dict[Any, int]] | None = None,
    ) -> tuple[list[nn.Module], dict[str, list]]:
        mapping = (partition_fn or PipelineStageModule._partition_evenly)(layers, num_stages)
        if len(mapping) != len(layers):
            raise ValueError("partition_fn must map every layer to a stage")
        mine = [layer for layer in layers if mapping[layer] == stage_idx]
        return mine, PipelineStageModule._gather_pp_stage_idxs_for_weight_sharing(mapping, stage_idx)

    @staticmethod
    def _gather_pp_stage_idxs_for_weight_sharing(
        stage_idx_mapping: dict[Any, int], current_stage_idx: int
    ) -> dict[str, list]:
        """For each sharing group with a layer on ``current_stage_idx``: ``[sorted stages holding it, [layer,
        weight path]]``."""
        stages: dict[str, set[int]] = {}
        local: dict[str, list] = {}
        for layer, stage in stage_idx_mapping.items():
            for group, path in getattr(layer, WEIGHT_SHARING_ATTR_NAME, {}).items():
                stages.setdefault(group, set()).add(stage)
                if stage == current_stage_idx:
                    local[group] = [layer, path]
        return {group: [sorted(stages[group]), entry] for group, entry in local.items()}

    @staticmethod
    def mark_weight_sharing(
        layer_and_weight_path: list[tuple[nn.Module, str]], sharing_group_name: str = "default"
    ) -> None:
        """Mark the weights at ``weight_path`` of these layers as one shared weight (they must have one shape)."""
        shape = None
        for layer, path in layer_and_weight_path:
            marks = layer.__dict__.setdefault(WEIGHT_SHARING_ATTR_NAME, {})
            if sharing_group_name in marks:
                raise RuntimeError(f"weight sharing group {sharing_group_name!r} is already marked on {layer}")
            marks[sharing_group_name] = path
            weight = operator.attrgetter(path)(layer)
            if not isinstance(weight, torch.Tensor):
                raise TypeError(f"{path} of {type(layer).__name__} is not a tensor")
            if shape is not None and weight.shape != shape:
                raise ValueError("all shared weights must have the same shape")
            shape = weight.shape


def shared_weight_groups(layers: Sequence[nn.Module], mapping: dict[Any, int]) -> dict[str, list[tuple[int, int, str]]]:
    """Every weight-sharing group of ``layers`` (placed on stages by ``mapping``): its ``(stage, layer index, weight
    path)`` entries in layer order. Two marked layers on one stage must hold the same tensor (a shared weight is
    one tensor within a process)."""
    groups: dict[str, list[tuple[int, int, str]]] = {}
    for index, layer in enumerate(layers):
        for group, path in getattr(layer, WEIGHT_SHARING_ATTR_NAME, {}).items():
            groups.setdefault(group, []).append((mapping[layer], index, path))
    for group, entries in groups.items():
        by_stage: dict[int, Any] = {}
        for stage, index, path in entries:
            weight = operator.attrgetter(path)(layers[index])
            if by_stage.setdefault(stage, weight) is not weight:
                raise ValueError(
                    f"weight sharing group {group!r}: two layers on stage {stage} hold different tensors; layers on "
                    "one stage share a weight by holding the same tensor"
                )
    return groups


__all__ = ["WEIGHT_SHARING_ATTR_NAME", "PipelineStageModule", "shared_weight_groups"]
