"""``apex.transformer`` as a view over meshpar: every module at apex's path (``parallel_state``, ``tensor_parallel``,
``pipeline_parallel``, ``microbatches``, ``enums``, ``log_util``, ``utils``, ``amp``, ``functional``, ``layers``,
``_data``), each translating apex's calls, names and conventions to meshpar's core (see docs/compat.md)."""

from meshpar.compat.apex import (
    _data,
    amp,
    enums,
    functional,
    layers,
    log_util,
    microbatches,
    parallel_state,
    pipeline_parallel,
    tensor_parallel,
    utils,
)
from meshpar.compat.apex.enums import AttnMaskType, AttnType, LayerType

__all__ = [
    "AttnMaskType",
    "AttnType",
    "LayerType",
    "_data",
    "amp",
    "enums",
    "functional",
    "layers",
    "log_util",
    "microbatches",
    "parallel_state",
    "pipeline_parallel",
    "tensor_parallel",
    "utils",
]
