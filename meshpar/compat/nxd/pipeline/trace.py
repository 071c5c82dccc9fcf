"""``neuronx_distributed.pipeline.trace``: NxD's tracing of a model's forward for pipeline cuts, on torch.fx
(meshpar's :mod:`meshpar.pipeline.trace`, which ``NxDPPModel`` uses without a ``loss_fn``)."""

from meshpar.pipeline.trace import traced_stages

__all__ = ["traced_stages"]
