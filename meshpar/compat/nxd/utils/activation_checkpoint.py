"""``neuronx_distributed.utils.activation_checkpoint``: recompute chosen modules in backward.

meshpar's :func:`meshpar.data_parallel.apply_activation_checkpointing` does it in place (the module keeps its class
and FQNs, so checkpoints and optimizers see the same names; NxD's wrapper hides its extra prefix from
``named_modules`` to the same end) and replays the tensor-parallel RNG, so dropout masks in sharded regions are
the same in the recompute. ``checkpoint_impl`` / ``checkpoint_fn`` (torch's wrapper options) are not taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from meshpar.data_parallel import _CheckpointedBlock
from meshpar.data_parallel import apply_activation_checkpointing as _apply


class NxDCheckpointWrapper(_CheckpointedBlock):
    """What a module recomputed in backward becomes: an instance of this class mixed into its own, in place (its
    class prints as ``NxDCheckpointWrapper<its class>``, so a printed model shows which blocks are checkpointed, as
    NxD's wrapper does)."""


def _refuse_options(checkpoint_impl: Any, checkpoint_fn: Any, kwargs: dict[str, Any]) -> None:
    if checkpoint_fn is not None or kwargs or checkpoint_impl is not None:
        raise NotImplementedError(
            "checkpoint_wrapper: checkpoint_impl / checkpoint_fn / their keywords are torch_xla's checkpoint options; "
            "meshpar recomputes with its own (non-reentrant, tp-RNG-replaying) checkpoint"
        )


def checkpoint_wrapper(
    module: nn.Module, checkpoint_impl: Any = None, checkpoint_fn: Callable[..., Any] | None = None, **kwargs: Any
) -> nn.Module:
    """``module`` made to recompute its forward in backward (in place; returned for NxD's call pattern)."""
    _refuse_options(checkpoint_impl, checkpoint_fn, kwargs)
    holder = nn.Module()
    holder.block = module
    _apply(holder, check_fn=lambda m: m is module, wrapper=NxDCheckpointWrapper)
    return module


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
) -> nn.Module:
    """Every submodule for which ``check_fn`` holds recomputes in backward. An ``NxDPPModel`` checkpoints its
    ``transformer_layer_cls`` layers (``check_fn`` ignored, as in NxD), once its stages exist; an ``NxDModel`` its
    local modules."""
    if checkpoint_wrapper_fn is not checkpoint_wrapper:
        raise NotImplementedError("apply_activation_checkpointing: a custom checkpoint_wrapper_fn is not supported")
    from meshpar.compat.nxd.pipeline.model import NxDPPModel

    target = getattr(model, "module", model) if type(model).__name__ == "NxDModel" else model
    if isinstance(target, NxDPPModel):
        layer_cls = target.transformer_layer_cls

        def wrap_local_layers() -> None:
            for module in target.local_modules():
                _apply(module, layer_cls, wrapper=NxDCheckpointWrapper)

        target.when_partitioned(wrap_local_layers)  # a pipeline traced at its first step: its layers then
        return model
    _apply(target, check_fn=check_fn, wrapper=NxDCheckpointWrapper)
    return model


__all__ = ["NxDCheckpointWrapper", "apply_activation_checkpointing", "checkpoint_wrapper"]
