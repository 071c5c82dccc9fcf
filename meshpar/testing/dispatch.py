"""Counting what a region dispatches: aten ops (compute, collectives, host syncs) and collectives by name.

Used by the tests that pin the hot path and by the benchmarks that print the same counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from meshpar._compat import CommDebugMode, TorchDispatchMode

_METADATA_OPS = frozenset(
    {"view", "_unsafe_view", "t", "transpose", "permute", "unbind", "as_strided", "detach", "alias"}
)
_SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal"})
# eager c10d names -> the functional collectives' names
_COLLECTIVE_NAMES = {
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather_into_tensor",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "alltoall_base_": "all_to_all_single",
}


class AtenOps(TorchDispatchMode):
    """The aten ops a region dispatches: ``compute`` (op name -> count; the ops that launch kernels, metadata-only
    views left out), ``collectives`` (c10d and functional; ``collective_names``: by name, eager c10d names mapped
    onto the functional ones, waits and async-result wrapping left out) and ``syncs`` (ops that read a value back
    to the host). Counted where ops are dispatched, so every collective is seen once, in backward too
    (``CommDebugMode`` can count an eager c10d collective issued inside an autograd function's forward more than
    once)."""

    def __init__(self) -> None:
        super().__init__()
        self.compute: Counter = Counter()
        self.collectives = 0
        self.collective_names: Counter = Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collectives += 1
            if name not in ("wait_tensor", "_wrap_tensor_autograd"):  # completion and async-result wrapping
                self.collective_names[_COLLECTIVE_NAMES.get(name, name)] += 1
        elif name in _SYNC_OPS:
            self.syncs += 1
        elif func.namespace == "aten" and name not in _METADATA_OPS:
            self.compute[name] += 1
        return func(*args, **(kwargs or {}))


def comm_counts(mode: CommDebugMode) -> Counter:
    """Collective name -> count from a ``CommDebugMode``; eager c10d ops (``allreduce_``) and functional ones
    (``all_reduce``) under the same name."""
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        counts[_COLLECTIVE_NAMES.get(name, name)] += n
    return counts
