"""``apex.transformer.functional``: the fused scale-mask-softmax module on meshpar's softmax ops, and the rotary
position embedding functions (``sbhd``, packed ``thd`` and 2-D)."""

from meshpar.compat.apex.functional.fused_rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)
from meshpar.compat.apex.functional.fused_softmax import FusedScaleMaskSoftmax

__all__ = [
    "FusedScaleMaskSoftmax",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]
