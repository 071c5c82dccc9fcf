"""The original parameter names (FQNs) of a model in any layout.

Checkpoints and optimizer state are keyed by the names the parameters have in the user's model, so that a save in
one layout loads in any other. A wrapper's own ``named_parameters`` adds its prefixes (``module.`` for the
pp=1 wrapper, ``pipeline.chunks.0.stage.`` for pipeline stages), which no other layout shares; the stages and the
pp=1 module themselves keep the original names. Every FQN-keyed path asks this module for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def checkpoint_modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The modules whose own names are the original FQNs: the local stages of a pipeline or of a parallelized HF
    model (``local_modules()``), the chunks of a list, else the model itself."""
    local_modules = getattr(model, "local_modules", None)
    if callable(local_modules):
        return list(local_modules())
    return list(model) if isinstance(model, (list, tuple)) else [model]


def original_named_parameters(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """``(original FQN, parameter)`` for every parameter this rank holds, each parameter once."""
    seen: set[int] = set()
    named = []
    for module in checkpoint_modules(model):
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
    return named


def tied_of(model: object, tied: dict[str, str] | None) -> dict[str, str] | None:
    """``tied`` as given, else the model's own tied-parameter map (alias -> source) when it has one."""
    return tied if tied is not None else getattr(model, "tied_parameters", None)
