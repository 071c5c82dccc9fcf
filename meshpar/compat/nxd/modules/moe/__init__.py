"""``neuronx_distributed.modules.moe``: NxD's mixture-of-experts layer for training: routers (:mod:`.routing`),
expert MLPs split over tp and, with ``expert_model_parallel_size`` > 1, over ep (:mod:`.expert_mlps`), the ``MoE``
layer (:mod:`.model`) and the load-balancing loss (:mod:`.loss_function`)."""

from meshpar.compat.nxd.modules.moe import token_shuffling
from meshpar.compat.nxd.modules.moe.expert_mlps import ExpertMLPs
from meshpar.compat.nxd.modules.moe.loss_function import load_balancing_loss_func
from meshpar.compat.nxd.modules.moe.model import MoE
from meshpar.compat.nxd.modules.moe.model_utils import ACT2FN
from meshpar.compat.nxd.modules.moe.routing import RouterSinkhorn, RouterTopK

__all__ = [
    "ACT2FN",
    "ExpertMLPs",
    "MoE",
    "RouterSinkhorn",
    "RouterTopK",
    "load_balancing_loss_func",
    "token_shuffling",
]
