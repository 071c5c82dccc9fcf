"""``apex.transformer.tensor_parallel.cross_entropy``: cross entropy over vocab-sharded logits (meshpar's
:func:`meshpar.tensor_parallel.parallel_cross_entropy`), per token, with label smoothing."""

from __future__ import annotations

import torch

from meshpar.tensor_parallel import parallel_cross_entropy


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-token losses ``[...]`` from this tp rank's logits ``[..., vocab/tp]`` and the full targets ``[...]``."""
    return parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)


__all__ = ["vocab_parallel_cross_entropy"]
