"""``apex.transformer.log_util``: loggers under meshpar's logger, so one level setting governs both."""

from __future__ import annotations

import logging
import os


def get_transformer_logger(name: str) -> logging.Logger:
    """The logger for ``name`` (a module name or file path: its extension is dropped, as apex does)."""
    return logging.getLogger(f"meshpar.compat.apex.{os.path.splitext(os.path.basename(name))[0]}")


def set_logging_level(verbosity: int) -> None:
    """Set the level of meshpar's loggers (apex's own are children of it here)."""
    logging.getLogger("meshpar").setLevel(verbosity)


__all__ = ["get_transformer_logger", "set_logging_level"]
