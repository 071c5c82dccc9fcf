"""``neuronx_distributed.overrides``: NxD's replacements for transformers functions (:mod:`.transformer_overrides`)."""

from meshpar.compat.nxd.overrides import transformer_overrides

__all__ = ["transformer_overrides"]
