"""Bytes each rank sends per collective, counted from the c10d ops a region dispatches (for the benchmarks' tables)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class WireBytes(TorchDispatchMode):
    """Bytes each rank sends per collective with ring algorithms over ``p`` ranks: all-reduce ``2 (p-1)/p N``,
    all-gather and reduce-scatter ``(p-1)/p N`` for the full tensor ``N``. Activation collectives (>= 2-D) and the
    flat (1-D) ones (grad buffers, small bias and norm grads) are kept apart."""

    def __init__(self, p: int) -> None:
        super().__init__()
        self.p = p
        self.activations = 0.0
        self.flat = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if func.namespace in ("c10d", "_c10d_functional") and not any(k in name for k in ("wait", "_wrap")):
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            largest = max(tensors, key=lambda t: t.numel())
            full = largest.numel() * largest.element_size()
            gather = "all_gather" in name or "allgather" in name
            if gather and len(tensors) == 1:  # functional all-gather: only the input shard is an argument
                full *= self.p
            factor = (1 if gather or "reduce_scatter" in name else 2) * (self.p - 1) / self.p
            if largest.dim() > 1:
                self.activations += factor * full
            else:
                self.flat += factor * full
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> float:
        return self.activations + self.flat
