"""``neuronx_distributed.modules.attention``: rotary-embedding helpers (:mod:`.utils`)."""

from meshpar.compat.nxd.modules.attention import utils

__all__ = ["utils"]
