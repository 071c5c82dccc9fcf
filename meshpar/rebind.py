"""An optimizer built on a model before ``parallelize`` keeps training the parallel model.

OSLO's tutorial (and plenty of user code) builds the optimizer first and parallelizes after. Parallelizing replaces
parameters: tp shards become DTensors, FSDP makes parameters of its own, a pipeline stage holds only its part of the
model. A torch optimizer holds the original ``Parameter`` objects, and ``torch.utils.swap_tensors`` cannot turn a
plain tensor into a DTensor (their slots differ), so identity cannot be kept in place.

Instead ``parallelize`` records, for each original parameter, what replaced it on this rank (or that this rank holds
none), and a step pre-hook, registered once on ``torch.optim``, rewrites the parameter groups of any optimizer that
still holds originals at its next ``step()``: replacements in, parameters held by other ranks out, and ``foreach`` /
``fused`` off where a group now mixes DTensors with plain tensors (torch's multi-tensor kernels reject the mix).
The registry is process-wide because torch calls global optimizer hooks without any other context; it holds weak
references only, so it keeps no model alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from meshpar._compat import DTensor

# id(original) -> (the original, its replacement on this rank or None where another rank holds it)
_REPLACED: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}
_HOOK: list[object] = []  # the step pre-hook's handle, once registered


def record_replacements(pairs: Iterable[tuple[nn.Parameter, nn.Parameter | None]]) -> None:
    """Remember that each original parameter is now ``replacement`` (``None``: not held on this rank)."""
    for original, replacement in pairs:
        if replacement is original:
            continue
        key = id(original)
        _REPLACED[key] = (weakref.ref(original, lambda _, key=key: _REPLACED.pop(key, None)),
                          None if replacement is None else weakref.ref(replacement))  # fmt: skip
    if _REPLACED and not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_rebind))


def _replacement(param: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """(whether ``param`` was replaced, what replaced it: ``None`` if this rank no longer holds it)."""
    entry = _REPLACED.get(id(param))
    if entry is None or entry[0]() is not param:
        return False, None
    return True, None if entry[1] is None else entry[1]()


def _rebind(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if not _REPLACED:
        return
    for group in optimizer.param_groups:
        params, changed = [], False
        for param in group["params"]:
            replaced, replacement = _replacement(param)
            if not replaced:
                params.append(param)
                continue
            changed = True
            if optimizer.state.get(param):
                raise RuntimeError(
                    "an optimizer built before parallelize has already stepped (it holds state for the dense "
                    "parameters, which do not fit their shards): build it after parallelize, or before any step"
                )
            optimizer.state.pop(param, None)
            if replacement is not None:
                params.append(replacement)
        if changed:
            group["params"] = params
            if len({isinstance(p, DTensor) for p in params}) > 1:
                group["foreach"] = False
                if group.get("fused"):
                    group["fused"] = False
