"""``apex.transformer.utils``: divisibility helpers and the 1-D split / gather of a tensor over the tp group."""

from __future__ import annotations

import torch

from meshpar._compat import dist_all_gather_single
from meshpar.parallel_dims import get_parallel


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor) -> torch.Tensor:
    """This tp rank's contiguous 1/tp of the flattened tensor (its numel must divide by tp)."""
    dims = get_parallel()
    flat = tensor.reshape(-1)
    part = divide(flat.numel(), dims.tp)
    return flat[dims.tp_rank * part : (dims.tp_rank + 1) * part]


def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`split_tensor_into_1d_equal_chunks`: every tp rank's part, concatenated (flat)."""
    dims = get_parallel()
    out = torch.empty(tensor.numel() * dims.tp, dtype=tensor.dtype, device=tensor.device)
    dist_all_gather_single(out, tensor.contiguous(), group=dims.tp_mesh.get_group())
    return out


__all__ = ["divide", "ensure_divisibility", "gather_split_1d_tensor", "split_tensor_into_1d_equal_chunks"]
