"""The one way meshpar turns a module into its parallel version: in place, by changing its class.

torch's own composable APIs do exactly this: ``fully_shard`` and ``replicate`` set ``module.__class__`` to a
subclass made once per original class (``FSDPLinear``, cached in ``cls_to_fsdp_cls``). meshpar follows them, for the
same reasons:

- the module object stays the same one, so its parent, the hooks on it, tied parameters and every reference the model
  holds (HF's ``get_output_embeddings()``, generation utilities) keep working;
- its parameter FQNs do not change, so DCP checkpoints reshard by the model's own names and HF weights load as they
  are; a wrapper module would prefix every FQN;
- forward hooks cannot do the job: a tensor-parallel layer runs one autograd function over its local shards instead
  of the module's own forward (a pre-hook can change inputs and a post-hook outputs, not the computation between).

Nothing else in meshpar assigns ``__class__`` or replaces a module's ``forward``: :func:`become` for a fixed class
(``ColumnParallelLinear`` from an ``nn.Linear``), :func:`mix_into` for a mixin over whatever class the module has
(an HF norm, expert block, embedding subclass or model as a pipeline stage).
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)

# (mixin, original class) -> their subclass, made once (as torch's cls_to_fsdp_cls), so instances share one class
_MIXED: dict[tuple[type, type], type] = {}


def become(module: nn.Module, cls: type[M]) -> M:
    """Make ``module`` an instance of ``cls`` (a parallel version of the module's kind, e.g. ``nn.Linear`` ->
    ``ColumnParallelLinear``); the caller sets the state ``cls`` adds right after."""
    module.__class__ = cls
    return module  # type: ignore[return-value]


def mix_into(module: M, mixin: type, prefix: str) -> M:
    """Make ``module`` an instance of ``(mixin, type(module))``, named ``prefix + original name``: the mixin's
    methods (its ``forward``) come first, everything else is the original class's."""
    original = type(module)
    key = (mixin, original)
    if key not in _MIXED:
        _MIXED[key] = type(f"{prefix}{original.__name__}", (mixin, original), {})
    module.__class__ = _MIXED[key]
    return module
