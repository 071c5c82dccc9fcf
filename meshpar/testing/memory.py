"""Counting what autograd keeps for backward in a region: the activation-memory side of the dense comparisons."""

from __future__ import annotations

from types import TracebackType

import torch

from meshpar._compat import local_tensor


class SavedForBackward:
    """Total bytes of the tensors autograd saves for backward while the context is active.

    A DTensor counts as its local shard (what this rank holds). A checkpointed region installs its own hooks, which
    take precedence inside it, so what a checkpoint drops is not counted: comparing a run with and without
    checkpointing shows the activations it frees.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = local_tensor(tensor)
        self.bytes += local.numel() * local.element_size()
        return tensor

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, trace)
