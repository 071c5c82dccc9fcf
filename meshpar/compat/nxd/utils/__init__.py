"""``neuronx_distributed.utils``: NxD's CPU-mode switch and device helpers (``cpu_mode``, ``get_device``,
``mark_step``, ``master_print``), the ``hardware`` and ``HloMetadataLevel`` enums, and the submodules ``logger``,
``tensor_utils``, ``utils``, ``random``, ``batch_utils``, ``adamw_fp32_optim_params``, ``serialization`` and
``model_utils``.

``cpu_mode()`` reads ``NXD_CPU_MODE`` as NxD does; ``get_device()`` is the process's device either way (the CPU in
CPU mode, else :func:`meshpar.compat.nxd.xla.xla_device`: a GPU where there is one), since no XLA device exists here.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from meshpar.compat.nxd import xla
from meshpar.compat.nxd.utils import (
    adamw_fp32_optim_params,
    batch_utils,
    logger,
    model_utils,
    random,
    serialization,
    tensor_utils,
    utils,
)
from meshpar.compat.nxd.utils.utils import HloMetadataLevel, hardware


def cpu_mode() -> bool:
    return int(os.environ.get("NXD_CPU_MODE", "0")) > 0


def mark_step() -> None:
    """Nothing to cut in eager PyTorch (see :func:`meshpar.compat.nxd.xla.mark_step`)."""
    xla.mark_step()


def master_print(msg: object) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def get_device() -> torch.device:
    return torch.device("cpu") if cpu_mode() else xla.xla_device()


__all__ = [
    "HloMetadataLevel",
    "adamw_fp32_optim_params",
    "batch_utils",
    "cpu_mode",
    "get_device",
    "hardware",
    "logger",
    "mark_step",
    "master_print",
    "model_utils",
    "random",
    "serialization",
    "tensor_utils",
    "utils",
]
