"""``apex.transformer.pipeline_parallel``: ``get_forward_backward_func`` and ``build_model``; the schedules, the
neighbour transfers and apex's microbatch calculator in its submodules (``schedules``, ``p2p_communication``,
``utils``), each run on meshpar's pipeline executor and mesh."""

from meshpar.compat.apex.pipeline_parallel import p2p_communication, schedules, utils
from meshpar.compat.apex.pipeline_parallel.schedules import get_forward_backward_func
from meshpar.compat.apex.pipeline_parallel.schedules.common import build_model

__all__ = ["build_model", "get_forward_backward_func", "p2p_communication", "schedules", "utils"]
