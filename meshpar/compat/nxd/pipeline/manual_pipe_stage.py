"""``neuronx_distributed.pipeline.manual_pipe_stage``: a pipeline stage made of a slice of a model given as a list of
layers (``NxDPPModel(layers, manual_pp_partition=True)``), NxD's even partition and its weight-sharing marks.

Weights shared between layers placed on different stages (``mark_weight_sharing``) are not kept in sync by meshpar's
manual pipeline: ``NxDPPModel`` refuses such a model (:func:`refuse_weight_sharing`) instead of training two copies
that drift apart. Shared layers on the same stage share the tensor itself and need no mark.
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


def refuse_weight_sharing(layers: Sequence[nn.Module]) -> None:
    marked = [type(layer).__name__ for layer in layers if getattr(layer, WEIGHT_SHARING_ATTR_NAME, None)]
    if marked:
        raise NotImplementedError(
            f"NxDPPModel(manual_pp_partition=True): layers {marked} share weights (mark_weight_sharing); meshpar's "
            "manual pipeline does not keep weights shared across stages in sync"
        )


__all__ = ["WEIGHT_SHARING_ATTR_NAME", "PipelineStageModule", "refuse_weight_sharing"]
