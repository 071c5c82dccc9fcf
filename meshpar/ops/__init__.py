"""Fused kernels as torch custom ops (``torch.ops.meshpar.*``): Triton on CUDA, torch references on CPU.

Every op has a Triton kernel, a pure-torch reference (the CPU kernel and the test oracle), a fake kernel for
``torch.compile`` and autograd registered on the op. ``use_triton(False)`` or ``MESHPAR_USE_TRITON=0`` turns the
Triton kernels off.
"""

from meshpar.ops._dispatch import triton_available, triton_enabled, use_triton
from meshpar.ops.activations import bias_gelu, swiglu
from meshpar.ops.cross_entropy import vocab_ce_grad, vocab_ce_stats
from meshpar.ops.grouped_mm import grouped_mm
from meshpar.ops.layer_norm import layer_norm
from meshpar.ops.rms_norm import rms_norm
from meshpar.ops.rotary import rotary_embedding
from meshpar.ops.softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax

__all__ = [
    "bias_gelu",
    "grouped_mm",
    "layer_norm",
    "rms_norm",
    "rotary_embedding",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "swiglu",
    "triton_available",
    "triton_enabled",
    "use_triton",
    "vocab_ce_grad",
    "vocab_ce_stats",
]
