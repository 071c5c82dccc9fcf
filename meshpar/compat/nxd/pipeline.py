"""``neuronx_distributed.pipeline``: ``NxDPPModel`` (see :mod:`meshpar.pipeline.model`)."""

from meshpar.pipeline.model import NxDPPModel

__all__ = ["NxDPPModel"]
