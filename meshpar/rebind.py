"""An optimizer built on a model before ``parallelize``: pointed at the parallel model explicitly, or refused.

Parallelizing replaces parameters: tp shards become DTensors, FSDP makes parameters of its own, a pipeline stage
holds only its part of the model. A torch optimizer holds the original ``Parameter`` objects, and
``torch.utils.swap_tensors`` cannot turn a plain tensor into a DTensor (their slots differ), so identity cannot be
kept in place. An optimizer stepping the originals would train nothing, silently.

So ``parallelize`` records, on the parallel model, what replaced each original parameter on this rank (or that this
rank holds none). ``model.rebind_optimizer(optimizer)`` rewrites the optimizer's parameter groups from that record
(:func:`rebind`). An optimizer that still holds originals at its next ``step()`` is handed to the model that replaced
them (:func:`watch` installs one step pre-hook for that, the only way torch tells anyone that an optimizer steps):
meshpar's model refuses it, naming the remedy; OSLO's view, whose documented contract is that such an optimizer keeps
training, rebinds it there. The watch list holds weak references only, so it keeps no model or parameter alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from meshpar._compat import DTensor

# id(original) -> (the original, its replacement on this rank or None where another rank holds it)
Replacements = dict[int, tuple[weakref.ref, weakref.ref | None]]


class HoldsReplacements(Protocol):
    def stale_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...


# id(original) -> (the original, the parallel model that replaced it): what the step pre-hook looks for
_WATCHED: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_HOOK: list[object] = []  # the step pre-hook's handle, once registered


def replacements(pairs: Iterable[tuple[nn.Parameter, nn.Parameter | None]]) -> Replacements:
    """The record of what replaced each original parameter (``None``: not held on this rank), weakly held."""
    record: Replacements = {}
    for original, replacement in pairs:
        if replacement is not original:
            record[id(original)] = (weakref.ref(original), None if replacement is None else weakref.ref(replacement))
    return record


def watch(model: HoldsReplacements, record: Replacements) -> None:
    """Hand any optimizer that steps one of ``record``'s originals to ``model.stale_optimizer``."""
    owner = weakref.ref(model)
    for key, (original, _) in record.items():
        if original() is not None:
            _WATCHED[key] = (weakref.ref(original(), lambda _, key=key: _WATCHED.pop(key, None)), owner)
    if _WATCHED and not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_hand_to_owner))


def _hand_to_owner(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    owners: dict[int, HoldsReplacements] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _WATCHED.get(id(param))
            if entry is not None and entry[0]() is param and (model := entry[1]()) is not None:
                owners[id(model)] = model
    for model in owners.values():
        model.stale_optimizer(optimizer)


def _replaced(param: torch.Tensor, record: Mapping) -> tuple[bool, torch.Tensor | None]:
    """(whether ``param`` was replaced, what replaced it: ``None`` if this rank no longer holds it)."""
    entry = record.get(id(param))
    if entry is None or entry[0]() is not param:
        return False, None
    return True, None if entry[1] is None else entry[1]()


def rebind(optimizer: torch.optim.Optimizer, record: Mapping[int, tuple[weakref.ref, weakref.ref | None]]) -> None:
    """Rewrite ``optimizer``'s parameter groups: replacements in, parameters other ranks hold out. Groups that now
    mix DTensors with plain tensors get ``foreach`` / ``fused`` off (torch's multi-tensor kernels reject the mix).
    Refused once the optimizer has stepped: its state fits the dense parameters, not their shards."""
    for group in optimizer.param_groups:
        params, changed = [], False
        for param in group["params"]:
            replaced, replacement = _replaced(param, record)
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
