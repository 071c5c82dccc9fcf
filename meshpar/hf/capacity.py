"""Token dropping (an expert capacity factor) where an experts module sees its tokens out of the dense order or
only some of them: under sequence parallelism and context parallelism.

An expert's capacity counts the routes of one forward of one replica's tokens, and which routes it keeps depends on
the tokens' order (the earliest tokens' under the ``"position"`` policy; under ``"probs"`` equal weights, as equal
tokens get in the first layer, go to the earlier token). The dense model's experts see the rows ``[batch, seq]`` in
that order. Under sequence parallelism the experts gather the tp ranks' sequence shards, rows in (tp rank, batch,
position) order; under context parallelism each cp rank holds two chunks of every sequence. So each layer holding
capacity-limited experts records, on every forward, the grid of its input (``[batch, seq]`` as this rank holds it)
and whether it runs on this cp rank's chunks (its forward carries context parallelism's inputs); the experts turn
that into each row's place in the dense order (:func:`dense_token_order`), gather the routes of the whole replica
over cp, decide what to keep in the dense order and keep their own rows' share
(:func:`meshpar.expert_parallel.capacity_keep`). A forward over whole sequences on a cp rank (``generate()``, whose
decoding steps are not split) carries no such inputs and counts its own rows, as the dense model does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from meshpar._compat import DeviceMesh
from meshpar.context_parallel import local_positions


@dataclass
class TokenLayout:
    """Where the rows of one forward of an experts module sit in its replica's batch."""

    batch: int
    seq: int  # the layer input's sequence length on this rank (a tp shard under sequence parallelism)
    cp_mesh: DeviceMesh | None  # set when the layer ran on this cp rank's chunks


def record_token_layouts(modules: list[nn.Module], layers: str | None, context_parallel: bool) -> None:
    """Make every capacity-limited experts module that sees its tokens out of the dense order (under sequence
    parallelism) or some of them (``context_parallel``) learn its layer's input grid on each forward: a pre-hook on
    its layer, the child of the container ``layers`` (``"model.layers"``) holding it (see the module docstring)."""
    from meshpar.hf.context_parallel import INPUTS_KEY  # (imported here: that module imports the experts')
    from meshpar.hf.experts import _LocalExperts

    for root in modules:
        for name, module in root.named_modules():
            if not isinstance(module, _LocalExperts) or module.capacity is None:
                continue
            if not (module.sequence_parallel or context_parallel):  # the rows in the dense order, all of them
                continue
            index, _, inner = name.removeprefix(f"{layers}.").partition(".")
            if layers is None or not name.startswith(f"{layers}.") or not inner:
                raise ValueError(
                    f"{name}: an expert capacity factor under sequence or context parallelism needs the experts inside "
                    f"the model's layers ({layers}), whose input gives the tokens' order; leave expert_capacity_factor "
                    "unset"
                )
            layer = root.get_submodule(f"{layers}.{index}")
            layer.register_forward_pre_hook(partial(_record, experts=inner, context_key=INPUTS_KEY), with_kwargs=True)
            module.token_layout_recorded = True


def _record(layer: nn.Module, args: tuple, kwargs: dict[str, Any], *, experts: str, context_key: str) -> None:
    hidden = args[0] if args else kwargs.get("hidden_states")
    context = kwargs.get(context_key)
    module = layer.get_submodule(experts)
    cp_mesh = context.mesh if context is not None else None
    fits = torch.is_tensor(hidden) and hidden.dim() == 3
    module.token_layout = TokenLayout(*hidden.shape[:2], cp_mesh) if fits else None


def dense_token_order(
    layout: TokenLayout | None, rows: int, tp_mesh: DeviceMesh, sequence_parallel: bool, device: torch.device
) -> torch.Tensor:
    """Each of this rank's ``rows`` (the layer input's ``[batch, seq]`` flattened) as its index in the replica's
    whole batch flattened, ``batch * whole sequence + global position``."""
    if layout is None or layout.batch * layout.seq != rows:
        got = "no [batch, seq, hidden] layer input" if layout is None else f"a {layout.batch} x {layout.seq} input"
        raise RuntimeError(
            f"an expert capacity factor under sequence or context parallelism needs the {rows} rows the experts got "
            f"to be their layer's [batch, seq] tokens, but this forward had {got}; leave expert_capacity_factor unset"
        )
    positions, length = torch.arange(layout.seq, device=device), layout.seq
    if sequence_parallel:  # this tp rank's shard of the (cp rank's) sequence
        positions, length = positions + tp_mesh.get_local_rank() * layout.seq, length * tp_mesh.size()
    if layout.cp_mesh is not None:  # this cp rank's two chunks of the whole sequence
        cp = layout.cp_mesh.size()
        positions = local_positions(length * cp, cp, layout.cp_mesh.get_local_rank(), device)[positions]
        length *= cp
    return (torch.arange(layout.batch, device=device).unsqueeze(-1) * length + positions).reshape(-1)


@contextlib.contextmanager
def dropless(model: nn.Module) -> Iterator[None]:
    """``model``'s experts dropping nothing inside (a probe proven against the dense forward, which drops nothing)."""
    from meshpar.hf.experts import _LocalExperts

    limited = [m for m in model.modules() if isinstance(m, _LocalExperts) and m.capacity is not None]
    saved = [m.capacity for m in limited]
    for module in limited:
        module.capacity = None
    try:
        yield
    finally:
        for module, capacity in zip(limited, saved, strict=True):
            module.capacity = capacity
