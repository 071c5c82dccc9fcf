"""``neuronx_distributed.pipeline``: ``NxDPPModel`` (:mod:`.model`) and NxD's tracing helpers (:mod:`.trace`)."""

from meshpar.compat.nxd.pipeline import model, trace
from meshpar.compat.nxd.pipeline.model import NxDPPModel

__all__ = ["NxDPPModel", "model", "trace"]
