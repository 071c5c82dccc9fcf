"""``neuronx_distributed.modules.attention.utils``: rotary position embeddings as NxD's models compute them: the
angle table (``precompute_freqs_cis``, optionally with Llama 3.1's frequency scaling, ``apply_scaling``) and the
rotation of interleaved (real, imaginary) pairs of q and k (``apply_rotary_polar_compatible``), which matches the
complex-number formulation of Meta's reference code."""

from __future__ import annotations

import math
from typing import Any

import torch

# Llama 3.1's scaling: frequencies with wavelengths past 8192 / 1 tokens are divided by 8, those under 8192 / 4 kept,
# and the ones between blended smoothly
ROPE_DEFAULTS = {"factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}


def apply_scaling(freqs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``freqs`` rescaled for a longer context (``kwargs`` override :data:`ROPE_DEFAULTS`)."""
    params = {**ROPE_DEFAULTS, **kwargs}
    original = params["original_max_position_embeddings"]
    low_wavelen = original / params["low_freq_factor"]
    high_wavelen = original / params["high_freq_factor"]
    if low_wavelen == high_wavelen:
        raise ValueError("low_freq_factor and high_freq_factor must differ")
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - params["low_freq_factor"]) / (params["high_freq_factor"] - params["low_freq_factor"])
    blended = (1 - smooth) * freqs / params["factor"] + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / params["factor"], blended)
    return torch.where(wavelen < high_wavelen, freqs, scaled)


def precompute_freqs_cis(
    dim: int, end: int, theta: float = 10000.0, use_scaled: bool = False, device: Any = None, **kwargs: Any
) -> torch.Tensor:
    """The ``[end, dim // 2]`` table of rotation angles: position times each pair's frequency (float32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    if use_scaled:
        freqs = apply_scaling(freqs, **kwargs)
    return torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)


def apply_rotary_polar_compatible(
    query: torch.Tensor, key: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` and ``key`` (``[b, s, h, d]``) with each interleaved pair ``(x[2i], x[2i+1])`` rotated by its angle
    in ``freqs_cis`` (``[b, s, d // 2]``: the table of :func:`precompute_freqs_cis` indexed by each token's position;
    float32, the angles need the precision)."""
    if freqs_cis.dtype != torch.float32:
        raise ValueError(f"Expect freqs_cis.dtype == torch.float32 to ensure accuracy, got {freqs_cis.dtype}")
    cos, sin = freqs_cis.cos().unsqueeze(2), freqs_cis.sin().unsqueeze(2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        real, imag = x[..., ::2], x[..., 1::2]
        return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).reshape(x.shape)

    return rotate(query).type_as(query), rotate(key).type_as(key)


__all__ = ["ROPE_DEFAULTS", "apply_rotary_polar_compatible", "apply_scaling", "precompute_freqs_cis"]
