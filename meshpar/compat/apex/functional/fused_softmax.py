"""``apex.transformer.functional.fused_softmax``: scale, mask and softmax of attention scores ``[b, np, sq, sk]``.

The fused path runs meshpar's softmax ops (:mod:`meshpar.ops.softmax`, a Triton kernel where available, computing in
float32 and returning the input's dtype) where apex would run its CUDA kernel: fusion asked for, half-precision input,
a padding or causal mask. meshpar's kernels have none of apex's size limits, so they run for every such shape.
Everything else takes apex's torch path (``mask_func``, softmax in float32 when asked) unchanged. Under autocast the
fused functions take their inputs in the autocast dtype, as apex's do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshpar.compat.apex.enums import AttnMaskType
from meshpar.ops.softmax import scaled_masked_softmax as _masked
from meshpar.ops.softmax import scaled_upper_triang_masked_softmax as _causal

__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericScaledMaskedSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "generic_scaled_masked_softmax",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
]


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would compute in here: apex's fused softmax takes its inputs in the autocast dtype (of
    CUDA, as apex checks, or of the input's own device)."""
    for device_type in dict.fromkeys(("cuda", tensor.device.type)):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


def _under_autocast(fn: object, inputs: torch.Tensor, *rest: object) -> torch.Tensor:
    """Run ``fn`` on ``inputs`` cast to the autocast dtype (when autocast is on), with autocast off inside."""
    dtype = _autocast_dtype(inputs)
    if dtype is None:
        return fn(inputs, *rest)
    with torch.autocast(inputs.device.type, enabled=False):
        return fn(inputs.to(dtype) if inputs.is_floating_point() else inputs, *rest)


def _bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    return mask if mask is None or mask.dtype == torch.bool else mask.bool()


def scaled_upper_triang_masked_softmax(inputs: torch.Tensor, _: object, scale: float) -> torch.Tensor:
    """Causal: ``inputs`` ``[b, np, sq, sk]`` (apex's 3-D ``[b*np, sq, sk]`` too)."""
    if inputs.dim() == 3:
        return _under_autocast(lambda x: _causal(x.unsqueeze(1), scale).squeeze(1), inputs)
    return _under_autocast(lambda x: _causal(x, scale), inputs)


def scaled_masked_softmax(inputs: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``mask`` is ``True`` (or 1) where a score is masked out."""
    return _under_autocast(lambda x: _masked(x, _bool_mask(mask), scale), inputs)


generic_scaled_masked_softmax = scaled_masked_softmax


def scaled_softmax(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    return _under_autocast(lambda x: _masked(x, None, scale), inputs)


class ScaledUpperTriangMaskedSoftmax:
    """apex's autograd function, as ``ScaledUpperTriangMaskedSoftmax.apply(inputs, scale)`` (meshpar's op carries
    its own autograd)."""

    @staticmethod
    def apply(inputs: torch.Tensor, scale: float) -> torch.Tensor:
        return scaled_upper_triang_masked_softmax(inputs, None, scale)


class ScaledMaskedSoftmax:
    """``ScaledMaskedSoftmax.apply(inputs, mask, scale)``."""

    @staticmethod
    def apply(inputs: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        return scaled_masked_softmax(inputs, mask, scale)


GenericScaledMaskedSoftmax = ScaledMaskedSoftmax


class ScaledSoftmax:
    """``ScaledSoftmax.apply(inputs, scale)``."""

    @staticmethod
    def apply(inputs: torch.Tensor, scale: float) -> torch.Tensor:
        return scaled_softmax(inputs, scale)


def _is(mask_type: object, member: AttnMaskType) -> bool:
    return getattr(mask_type, "name", mask_type) == member.name


class FusedScaleMaskSoftmax(torch.nn.Module):
    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        softmax_in_fp32: bool,
        scale: float | None,
    ) -> None:
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise RuntimeError("both fp16 and bf16 flags cannot be active at the same time.")
        if not (scale is None or softmax_in_fp32):
            raise RuntimeError("softmax should be in fp32 when scaled")
        if scaled_masked_softmax_fusion and not (
            _is(attn_mask_type, AttnMaskType.causal) or _is(attn_mask_type, AttnMaskType.padding)
        ):
            raise ValueError("Invalid attn_mask_type.")
        self.input_in_fp16, self.input_in_bf16 = input_in_fp16, input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func, self.softmax_in_fp32, self.scale = mask_func, softmax_in_fp32, scale

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if input.dim() != 4:
            raise ValueError(f"attention scores must be [b, np, sq, sk], got {tuple(input.shape)}")
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask: torch.Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        return self.scaled_masked_softmax_fusion and self.input_in_float16

    def forward_fused_softmax(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0
        if _is(self.attn_mask_type, AttnMaskType.causal):
            return scaled_upper_triang_masked_softmax(input, None, scale)
        return scaled_masked_softmax(input, mask, scale)

    def forward_torch_softmax(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        masked = self.mask_func(input, mask) if mask is not None else input
        probs = torch.softmax(masked, dim=-1)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs


class GenericFusedScaleMaskSoftmax(FusedScaleMaskSoftmax):
    """apex's variant for any key length; meshpar's kernel has no limit, so it is the same module."""
