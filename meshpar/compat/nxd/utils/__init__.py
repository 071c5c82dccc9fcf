"""``neuronx_distributed.utils``: NxD's logger (:mod:`.logger`) and tensor helpers (:mod:`.tensor_utils`)."""

from meshpar.compat.nxd.utils import logger, tensor_utils

__all__ = ["logger", "tensor_utils"]
