"""Every private or version-sensitive torch import of meshpar lives here.

A torch upgrade that moves one of these names should only need a change in this file.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "ParallelStyle",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "funcol",
    "init_device_mesh",
]
