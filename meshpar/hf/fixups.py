"""Plan fix-ups for modules that compute statistics over the features tensor parallelism splits.

A fix-up is ``fn(module, tp)``, run on the sharded modules its plan entry names (:func:`meshpar.hf.hf_plan.fixup_on`);
each here is a class, so that plans pickle, and proven like any plan by the one-block verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshpar._compat import DeviceMesh
from meshpar._in_place import mix_into
from meshpar.tensor_parallel._collectives import copy_to_tp, reduce_from_tp


def _sum_over_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A sum every rank holds a part of and every rank goes on to use: summed over tp forward, and its grad (each
    rank's use contributes one) summed over tp backward."""
    return copy_to_tp(reduce_from_tp(x, mesh), mesh)


class _GaussianTopkOverTP:
    """Gemma-3n's MLP activation sparsity over tp: ``_gaussian_topk`` keeps each token's gate activations above
    ``mean + k * std`` of its intermediate features, of which this rank holds ``1 / tp``; mean and (biased) variance
    are taken over all of them, in two passes as ``torch.std`` does."""

    tp_mesh: DeviceMesh
    activation_sparsity: float

    def _gaussian_topk(self, inputs: torch.Tensor) -> torch.Tensor:
        mesh = self.tp_mesh
        features = inputs.shape[-1] * mesh.size()
        mean = _sum_over_tp(inputs.sum(-1, keepdim=True), mesh) / features
        std = (_sum_over_tp((inputs - mean).square().sum(-1, keepdim=True), mesh) / features).sqrt()
        sparsity = torch.tensor(self.activation_sparsity, dtype=torch.float32, device=inputs.device)
        multiplier = torch.distributions.normal.Normal(0, 1).icdf(sparsity).to(inputs.dtype)
        return nn.functional.relu(inputs - (mean + std * multiplier))


@dataclass(frozen=True)
class gaussian_topk_over_tp:  # noqa: N801 - used like a function in plan dicts
    """Fix-up for an MLP with Gemma-3n's activation sparsity whose ``gate_proj`` is column-parallel."""

    def __call__(self, module: nn.Module, tp: int) -> None:
        if tp == 1 or not getattr(module, "activation_sparsity", 0.0):
            return
        mix_into(module, _GaussianTopkOverTP, "TensorParallel")
        module.tp_mesh = module.gate_proj.tp_mesh
