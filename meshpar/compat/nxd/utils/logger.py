"""``neuronx_distributed.utils.logger``: NxD's named loggers (level from ``NXD_LOG_LEVEL``), by default quiet on
every rank but global rank 0."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist

T = TypeVar("T")
P = ParamSpec("P")

_LEVELS = {"off": logging.FATAL + 1, "fatal": logging.FATAL, "error": logging.ERROR, "warning": logging.WARNING,
           "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}  # fmt: skip


def get_log_level() -> int:
    """The level ``NXD_LOG_LEVEL`` names (``off``, ``fatal``, ``error``, ``warning``, ``info``, ``debug``)."""
    name = os.environ.get("NXD_LOG_LEVEL", "info").lower()
    if name not in _LEVELS:
        raise ValueError(f"NXD_LOG_LEVEL={name!r}; expected one of {sorted(_LEVELS)}")
    return _LEVELS[name]


class PackagePathFilter(logging.Filter):
    """Adds ``record.relativepath``: the record's file relative to the longest ``sys.path`` entry holding it."""

    def filter(self, record: Any) -> bool:
        record.relativepath = None
        for root in sorted(map(os.path.abspath, sys.path), key=len, reverse=True):
            root = root if root.endswith(os.sep) else root + os.sep
            if record.pathname.startswith(root):
                record.relativepath = os.path.relpath(record.pathname, root)
                break
        return True


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0


def get_logger(name: str = "neuronx_distributed", rank0_only: bool = True) -> logging.Logger:
    """The logger ``name`` (configured once), emitting on global rank 0 only unless ``rank0_only=False``."""
    logger = logging.getLogger(name + ("[0]" if rank0_only else "[]"))
    if not getattr(logger, "initialized", False):
        logger.setLevel(get_log_level())
        if rank0_only:
            logger.addFilter(_RankZeroFilter())
        logger.initialized = True
    return logger


__all__ = ["P", "PackagePathFilter", "T", "get_log_level", "get_logger"]
