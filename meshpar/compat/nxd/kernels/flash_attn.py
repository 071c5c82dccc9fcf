"""``neuronx_distributed.kernels.flash_attn``: NxD's flash-attention entry point with its signature and layouts,
computed by torch's ``scaled_dot_product_attention`` (flash attention on CPU and CUDA) instead of Neuron's NKI kernel.

NxD's layouts: with ``transpose_nki_inputs=True`` (its default) q, k and v come as ``[batch, heads, head_dim, seq]``,
else as ``[batch, heads, seq, head_dim]``; the output is ``[batch, heads, seq, head_dim]`` either way. Key/value heads
may be fewer than query heads (grouped queries). Differences, each a Neuron detail: any sequence length (NxD's kernel
takes multiples of 2048), ``lnc`` / ``hardware_type`` / ``mixed_precision`` select Neuron kernels and change nothing
here (torch's kernels keep the softmax in fp32 for half-precision inputs), and dropout draws from torch's generator,
so a ``seed`` tensor (the Neuron RNG's) is refused with dropout on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshpar.compat.nxd.parallel_layers.mappings import traced_as_call


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    seed: Any,
) -> torch.Tensor:
    """Attention of ``[batch, heads, seq, head_dim]`` inputs (fewer key/value heads allowed), the one computation
    behind NxD's flash and ring entry points."""
    if seed is not None and dropout_p > 0:
        raise NotImplementedError(
            "a dropout seed tensor drives Neuron's RNG; here attention dropout draws from torch's generator "
            "(seed it with torch.manual_seed, and pass seed=None)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
    )


@traced_as_call  # one call in a pipeline's fx trace, however the model imports it
def nki_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lnc: int = 1,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = True,
    mixed_precision: bool = True,
    seed: Any = None,
    hardware_type: Any = None,
    transpose_nki_inputs: bool = True,
) -> torch.Tensor:
    """NxD's flash attention: ``[batch, heads, seq, head_dim]`` out (inputs' layout per ``transpose_nki_inputs``,
    see the module docstring); ``softmax_scale`` defaults to ``head_dim ** -0.5``."""
    if transpose_nki_inputs:  # [batch, heads, head_dim, seq] in
        q, k, v = (t.transpose(-1, -2) for t in (q, k, v))
    return attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, seed=seed)


__all__ = ["nki_flash_attn_func"]
