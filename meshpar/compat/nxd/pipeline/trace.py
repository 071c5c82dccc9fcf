"""``neuronx_distributed.pipeline.trace``: NxD's torch.fx tracing of a model's forward, with NxD's signatures.

``trace_model(model, args, kwargs, input_names, tracer_cls, leaf_modules, ...)`` returns the traced ``GraphModule``
as NxD builds it: NxD's parallel layers (and the MoE layer) always leaves, its parallel region functions always
wrapped, ``math`` wrapped, dead code and unused submodules dropped. Leaves named by string match as NxD matches them:
a module is a leaf when a name is part of its class name or equals its qualified name. ``get_tracer_class`` picks
NxD's tracer classes (``TorchTracerWrapper``; ``HFTracerWrapper`` only where the installed transformers still has
an fx tracer: transformers 5 dropped it). ``NxDPPModel`` splits its model with meshpar's own tracing
(:mod:`meshpar.pipeline.trace`), which takes the same arguments. ``autowrap_obj_methods`` (NxD's patching of bound
methods, through torch.fx internals) is refused.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from meshpar.compat.nxd.utils.model_utils import is_hf_pretrained_model
from meshpar.pipeline.trace import traced_stages

try:  # transformers 4's fx tracer; transformers 5 has none
    from transformers.utils.fx import HFTracer
except ImportError:
    HFTracer = None


def _names_and_classes(leaf_modules: Sequence[Any]) -> tuple[tuple[str, ...], tuple[type, ...]]:
    names = tuple(entry for entry in leaf_modules if isinstance(entry, str))
    return names, tuple(entry for entry in leaf_modules if isinstance(entry, type))


class NxDTracer(fx.Tracer):
    """A torch.fx tracer that keeps the modules its ``leaf_modules`` name as calls: a module is a leaf when one of
    the names is part of its class name or is its qualified name (NxD's rule); classes are taken too."""

    leaf_modules: Sequence[Any] = ()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        names, classes = _names_and_classes(self.leaf_modules)
        cls = type(m).__name__
        if isinstance(m, classes) or any(name in cls or name == module_qualified_name for name in names):
            return True
        return super().is_leaf_module(m, module_qualified_name)


class TorchTracerWrapper(NxDTracer):
    """NxD's tracer for plain torch models: built from ``leaf_modules``, ``autowrap_modules`` and
    ``autowrap_functions``; parameters' shapes read as constants while tracing (``param_shapes_constant``)."""

    def __init__(self, **config: Any) -> None:
        super().__init__(
            autowrap_modules=tuple(config.get("autowrap_modules") or (math,)),
            autowrap_functions=tuple(config.get("autowrap_functions") or ()),
            param_shapes_constant=True,
        )
        self.leaf_modules = list(config.get("leaf_modules") or ())
        self.name = "pytorch"


if HFTracer is not None:

    class HFTracerWrapper(NxDTracer, HFTracer):
        """NxD's tracer for HuggingFace models (transformers' fx tracer with NxD's leaves)."""

        def __init__(self, **config: Any) -> None:
            super().__init__(
                autowrap_modules=tuple(config.get("autowrap_modules") or (math,)),
                autowrap_functions=tuple(config.get("autowrap_functions") or ()),
            )
            self.leaf_modules = list(config.get("leaf_modules") or ())
            self.name = "HF"


def _no_hf_tracer() -> NotImplementedError:
    return NotImplementedError(
        "tracer_cls='hf': the installed transformers has no fx tracer (transformers.utils.fx.HFTracer, dropped in "
        "transformers 5); use tracer_cls='torch', or meshpar.parallelize for HuggingFace models"
    )


def get_tracer_class(model: nn.Module | None = None, tracer_cls: Any = None) -> type[fx.Tracer]:
    """NxD's choice of tracer: ``None`` -> the HF tracer for a HuggingFace model, else ``TorchTracerWrapper``;
    ``"torch"`` / ``"hf"`` by name (any other string is refused); a class is used as given."""
    if tracer_cls is None:
        tracer_cls = "hf" if model is not None and is_hf_pretrained_model(model) else "torch"
    if not isinstance(tracer_cls, str):
        return tracer_cls
    if tracer_cls == "torch":
        return TorchTracerWrapper
    if tracer_cls == "hf":
        if HFTracer is None:
            raise _no_hf_tracer()
        return HFTracerWrapper
    raise ValueError(f"Unsupported tracer_cls {tracer_cls!r}: 'torch', 'hf' or a torch.fx.Tracer subclass")


def get_concrete_args(
    model: nn.Module,
    input_names: Sequence[str] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The arguments of ``model.forward`` that are not traced, with their defaults. The traced ones are
    ``input_names``, or (NxD's rule when it is ``None``) the first ``len(args)`` parameters and the keys of
    ``kwargs``; a name that is no parameter of ``forward`` is refused. ``*args`` / ``**kwargs`` parameters take no
    concrete value and are left out (NxD lists them with an empty default)."""
    parameters = inspect.signature(model.forward).parameters
    if input_names is None:
        if args is None and kwargs is None:
            raise ValueError("get_concrete_args needs input_names, or the args / kwargs of a call to trace")
        input_names = [*list(parameters)[: len(args or ())], *(kwargs or {})]
    unknown = [name for name in input_names if name not in parameters]
    if unknown:
        raise ValueError(
            f"The model does not have input(s) named: {', '.join(unknown)}, expected a subset of the following: "
            f"{', '.join(parameters)}"
        )
    return {name: p.default for name, p in parameters.items()
            if name not in input_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # fmt: skip


@contextlib.contextmanager
def patch_obj_method(autowrap_obj_methods: dict | None) -> Iterator[None]:
    """NxD wraps the given objects' methods so that tracing calls them as leaves; refused here when any are given
    (it needs torch.fx internals): wrap such calls in functions and pass them as ``autowrap_functions``."""
    if autowrap_obj_methods:
        raise NotImplementedError(
            "autowrap_obj_methods (patching bound methods for tracing) is not supported; pass such calls as "
            "autowrap_functions"
        )
    yield


def trace_model(
    model: nn.Module,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    input_names: Sequence[str] | None = None,
    tracer_cls: Any = None,
    leaf_modules: Sequence[Any] | None = None,
    autowrap_functions: Sequence[Callable] | None = None,
    autowrap_modules: Sequence[Any] | None = None,
    autowrap_obj_methods: dict | None = None,
) -> fx.GraphModule:
    """``model.forward`` traced over ``input_names`` (or the parameters that ``args`` / ``kwargs`` fill), in NxD's
    argument order; a HuggingFace model's ``config`` rides on the result as in NxD."""
    from meshpar.compat.nxd.parallel_layers import PARALLEL_FUNCTIONS
    from meshpar.compat.nxd.pipeline.model import _leaf_classes

    tracer_type = get_tracer_class(model, tracer_cls)
    concrete = get_concrete_args(model, input_names, args, kwargs)
    leaves = [*(leaf_modules or ()), *_leaf_classes(None, None)]  # NxD's parallel layers always
    functions = list(dict.fromkeys([*(autowrap_functions or ()), *PARALLEL_FUNCTIONS]))
    modules = list(dict.fromkeys([*(autowrap_modules or ()), math]))
    tracer = tracer_type(leaf_modules=leaves, autowrap_modules=modules, autowrap_functions=functions)
    with patch_obj_method(autowrap_obj_methods):
        traced = fx.GraphModule(model, tracer.trace(model, concrete_args=concrete))
    if is_hf_pretrained_model(model):
        traced.config = model.config
        traced.class_for_deserialization = type(model)
    traced.graph.eliminate_dead_code()
    traced.delete_all_unused_submodules()
    traced.graph.lint()
    traced.recompile()
    return traced


__all__ = [
    "NxDTracer",
    "TorchTracerWrapper",
    "get_concrete_args",
    "get_tracer_class",
    "patch_obj_method",
    "trace_model",
    "traced_stages",
]
if HFTracer is not None:
    __all__.append("HFTracerWrapper")
