"""``neuronx_distributed.utils.batch_utils``: NxD's label shift and its per-context-parallel-rank batch slice."""

from __future__ import annotations

import torch

from meshpar.compat.nxd.parallel_layers import parallel_state

IGNORE_INDEX = -100


def shift_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with ``labels`` moved one token left (the last position filled with -100, ignored)."""
    shifted = dict(batch)
    if "labels" in batch:
        labels = batch["labels"][:, 1:]
        pad = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
        shifted["labels"] = torch.cat((labels, pad), dim=1)
    return shifted


def get_batch_on_this_context_parallel_rank(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This context-parallel rank's contiguous slice of the sequence (dim 1) of every input, labels shifted first
    (the last label of the whole sequence -100: its next token is not in the batch); the batch itself at
    context-parallel size 1."""
    cp, cp_rank = parallel_state.get_context_model_parallel_size(), parallel_state.get_context_model_parallel_rank()
    if cp == 1:
        return batch
    out = {}
    for key, value in shift_labels(batch).items():
        if value is not None and value.dim() > 1 and value.shape[1] > 1:
            if value.shape[1] % cp != 0:
                raise ValueError(f"{key}: sequence length {value.shape[1]} is not divisible by the cp size {cp}")
            value = value.chunk(cp, dim=1)[cp_rank]
        out[key] = value
    return out


__all__ = ["get_batch_on_this_context_parallel_rank", "shift_labels"]
