"""``neuronx_distributed.utils.logger``: NxD's named loggers. The level comes from ``NXD_LOG_LEVEL`` (read once and
cached, as NxD's ``get_log_level``; ``cache_clear()`` re-reads it), records go to stdout with the file relative to
``sys.path``, and by default every logging method runs on global rank 0 alone (one line per job, not one per rank).
``NXD_LOG_LEVEL=off`` disables the logger."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

T = TypeVar("T")
P = ParamSpec("P")

_LEVELS = {"off": logging.FATAL + 1, "fatal": logging.FATAL, "error": logging.ERROR, "warning": logging.WARNING,
           "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}  # fmt: skip
_METHODS = ("debug", "info", "warning", "error", "exception", "fatal", "critical")


@functools.lru_cache
def get_log_level() -> int:
    """The level ``NXD_LOG_LEVEL`` names (``off``, ``fatal``, ``error``, ``warning``, ``info``, ``debug``,
    ``trace``; default ``info``)."""
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


def _global_rank() -> int:
    """torch.distributed's rank once a process group exists, else the launcher's ``RANK`` (0 when unset). Looked up
    through ``torch.distributed`` on each call, so a job that starts its process group later is seen."""
    distributed = torch.distributed
    if distributed.is_initialized():
        return distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _rank0_only(fn: Callable[P, T], default: T | None = None) -> Callable[P, T | None]:
    """``fn`` made to run on global rank 0 alone (``default`` elsewhere). A logging method wrapped so reports its
    caller's line, not this wrapper's: the wrapper adds one to ``stacklevel``."""

    @functools.wraps(fn)
    def on_rank_zero(*args: P.args, **kwargs: P.kwargs) -> T | None:
        if _global_rank() != 0:
            return default
        kwargs["stacklevel"] = int(kwargs.get("stacklevel", 1)) + 1
        return fn(*args, **kwargs)

    return on_rank_zero


def get_logger(name: str = "neuronx_distributed", rank0_only: bool = True) -> logging.Logger:
    """The logger ``name`` (``name[0]`` for the rank-0-only one, ``name[]`` otherwise), configured the first time it
    is asked for: a stdout handler, the ``NXD_LOG_LEVEL`` level (``off``: disabled), no propagation to the root
    logger."""
    logger = logging.getLogger(name + ("[0]" if rank0_only else "[]"))
    if getattr(logger, "initialized", False):
        return logger
    clock = "" if os.environ.get("NXD_LOG_HIDE_TIME", "false").lower() in ("true", "1") else "%(asctime)s.%(msecs)03d: "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"[{clock}%(levelname).1s %(relativepath)s:%(lineno)d] %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    handler.addFilter(PackagePathFilter())
    logger.handlers = [handler]
    level = get_log_level()
    if level > logging.FATAL:
        logger.disabled = True
    else:
        logger.setLevel(level)
        if rank0_only:
            for method in _METHODS:
                setattr(logger, method, _rank0_only(getattr(logger, method)))
    logger.propagate = False
    logger.initialized = True
    return logger


__all__ = ["P", "PackagePathFilter", "T", "get_log_level", "get_logger"]
