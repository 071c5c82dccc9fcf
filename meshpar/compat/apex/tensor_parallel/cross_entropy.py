"""``apex.transformer.tensor_parallel.cross_entropy``: cross entropy over vocab-sharded logits (meshpar's
:func:`meshpar.tensor_parallel.parallel_cross_entropy`), per token, with label smoothing."""

from __future__ import annotations

import torch

from meshpar.parallel_dims import get_parallel
from meshpar.tensor_parallel import parallel_cross_entropy


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-token losses ``[...]`` from this tp rank's logits ``[..., vocab/tp]`` and the full targets ``[...]``."""
    return parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing, tp_mesh=get_parallel().tp_mesh)


__all__ = ["vocab_parallel_cross_entropy"]
