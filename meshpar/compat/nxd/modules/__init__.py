"""``neuronx_distributed.modules``: the grouped-query attention projection (:mod:`.qkv_linear`) and NxD's
RMSNorm (:mod:`.rms_norm`)."""

from meshpar.compat.nxd.modules import qkv_linear, rms_norm

__all__ = ["qkv_linear", "rms_norm"]
