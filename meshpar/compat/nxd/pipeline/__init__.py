"""``neuronx_distributed.pipeline``: ``NxDPPModel`` (:mod:`.model`), manual stages (:mod:`.manual_pipe_stage`),
NxD's tracing helpers (:mod:`.trace`), its schedules' task lists (:mod:`.scheduler`) and neighbour transfers
(:mod:`.comm`), its layer-placement helpers (:mod:`.partition`)."""

from meshpar.compat.nxd.pipeline import comm, manual_pipe_stage, model, partition, scheduler, trace
from meshpar.compat.nxd.pipeline.model import NxDPPModel

__all__ = ["NxDPPModel", "comm", "manual_pipe_stage", "model", "partition", "scheduler", "trace"]
