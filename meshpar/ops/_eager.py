"""The eager fast path of meshpar's custom ops: the op's own Python body, without the dispatcher.

A ``torch.library`` custom op with registered autograd goes through the dispatcher twice per call (the autograd
kernel, then the redispatch to the backend), around the same ``autograd.Function`` machinery that a plain Function
uses. In a plain eager call (plain tensors, no tracer, no dispatch mode, not compiling) nothing needs the
dispatcher: :func:`call` runs the op's body through a ``torch.autograd.Function`` built from the same
``setup_context`` / ``backward`` that are registered on the op (so gradients come from the same code either way),
or the bare body when no graph is recorded. ``benchmarks/bench_launch.py`` measures the two paths.

Everywhere else (``torch.compile``, ``make_fx``, fake tensors, DTensor, ``CommDebugMode``, functorch transforms) the
op itself is called, so the compiler and the tracers still see ``meshpar::*`` ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshpar._compat import custom_op_body, plain_eager_context

_FUNCTIONS: dict[int, type[torch.autograd.Function]] = {}


def register_autograd(op: Any, backward: Callable[..., Any], setup_context: Callable[..., None]) -> None:
    """``op.register_autograd(backward, setup_context=...)``, plus the same pair as the eager fast path's autograd."""
    op.register_autograd(backward, setup_context=setup_context)
    body = custom_op_body(op)
    if body is None:
        return

    # built with type() so the autograd node is named after the op ("Eager_rms_norm_fwdBackward")
    name = f"Eager_{getattr(op, '_name', 'op')}"
    methods = {
        "forward": staticmethod(body),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
    }
    _FUNCTIONS[id(op)] = type(name, (torch.autograd.Function,), methods)


def call(op: Any, *args: Any) -> Any:
    """``op(*args)``; in a plain eager call, its body without the dispatcher (with its autograd if registered)."""
    if plain_eager_context(args):
        records_graph = torch.is_grad_enabled() and _any_requires_grad(args)
        function = _FUNCTIONS.get(id(op))
        if records_graph and function is not None:
            return function.apply(*args)
        body = custom_op_body(op)  # no graph to record: autograd.Function.apply alone costs more than the dispatcher
        if body is not None and not records_graph:  # (an op without autograd keeps torch's behaviour for grads)
            return body(*args)
    return op(*args)


def _any_requires_grad(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
