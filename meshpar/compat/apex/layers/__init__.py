"""``apex.transformer.layers``: apex's layer norms on meshpar's norm op."""

from meshpar.compat.apex.layers.layer_norm import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]
