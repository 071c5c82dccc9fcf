"""``neuronx_distributed.pipeline.trace``: NxD's tracing of a model's forward for pipeline cuts, on torch.fx
(meshpar's :mod:`meshpar.pipeline.trace`, which ``NxDPPModel`` uses without a ``loss_fn``).

``trace_model`` returns the traced ``GraphModule``; NxD's parallel layers are always leaves and its parallel
region functions always wrapped, as in NxD. ``autowrap_obj_methods`` (NxD's patching of bound methods) is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from meshpar.pipeline.trace import _tracer_class, trace, traced_stages


def get_tracer_class(model: nn.Module | None = None, tracer_cls: Any = None) -> type[fx.Tracer]:
    """The fx tracer class for ``tracer_cls`` (``"torch"``/``None``, ``"hf"`` or a ``torch.fx.Tracer`` subclass)."""
    return _tracer_class(tracer_cls)


def get_concrete_args(model: nn.Module, input_names: Sequence[str]) -> dict[str, Any]:
    """The defaults of ``model.forward``'s arguments that are not traced (not in ``input_names``)."""
    parameters = inspect.signature(model.forward).parameters
    return {name: p.default for name, p in parameters.items()
            if name not in input_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # fmt: skip


class NxDTracer(fx.Tracer):
    """A torch.fx tracer that keeps NxD's parallel layers and ``leaf_modules`` as calls."""

    def __init__(self, leaf_modules: Sequence[type] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from meshpar.compat.nxd.pipeline.model import _leaf_classes

        self.leaf_modules = tuple(_leaf_classes(None, leaf_modules))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_modules) or super().is_leaf_module(m, module_qualified_name)


TorchTracerWrapper = NxDTracer


def patch_obj_method(autowrap_obj_methods: dict | None) -> None:
    if autowrap_obj_methods:
        raise NotImplementedError("autowrap_obj_methods (patching bound methods for tracing) is not supported")


def trace_model(
    model: nn.Module,
    input_names: Sequence[str] | None = None,
    leaf_modules: Sequence[Any] | None = None,
    autowrap_functions: Sequence[Callable] | None = None,
    autowrap_modules: Sequence[Any] | None = None,
    autowrap_obj_methods: dict | None = None,
    tracer_cls: Any = None,
) -> fx.GraphModule:
    """``model.forward`` traced over ``input_names`` (default: its arguments without defaults)."""
    from meshpar.compat.nxd.parallel_layers import PARALLEL_FUNCTIONS
    from meshpar.compat.nxd.pipeline.model import _leaf_classes

    patch_obj_method(autowrap_obj_methods)
    if input_names is None:
        parameters = inspect.signature(model.forward).parameters.values()
        input_names = [p.name for p in parameters if p.default is inspect.Parameter.empty
                       and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip
    return trace(
        model, input_names, tuple(_leaf_classes(model, leaf_modules)), tracer_cls=tracer_cls,
        autowrap_modules=tuple(autowrap_modules) if autowrap_modules else None,
        autowrap_functions=(*PARALLEL_FUNCTIONS, *(autowrap_functions or ())),
    )  # fmt: skip


__all__ = [
    "NxDTracer",
    "TorchTracerWrapper",
    "get_concrete_args",
    "get_tracer_class",
    "patch_obj_method",
    "trace_model",
    "traced_stages",
]
