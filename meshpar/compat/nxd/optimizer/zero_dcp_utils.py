"""``neuronx_distributed.optimizer.zero_dcp_utils``: a ZeRO-1 optimizer's state saved and loaded with torch's
distributed checkpointing (one directory: DCP's ``.metadata`` and a ``__R_0.distcp`` file per rank), as NxD's
``save_checkpoint(..., use_zero1_dcp=True)`` writes it.

``aux = get_dcp_aux_infos(model, optimizer)`` names the optimizer's parameters after the model's;
``save_optim_state_dict(path, optimizer.state_dict(), aux)`` and ``load_optim_state_dict(path, optimizer, aux)``
are collective. Every entry is keyed ``state.<parameter name>.<state name>``, with ``|pp-NNNN`` / ``|tp-NNNN``
appended as NxD does (the stage and tp rank it belongs to, wherever that size exceeds one; with ``dedup=True`` a
parameter tp does not shard carries no tp suffix and is stored once). The view's ZeRO-1 gives each dp rank whole
parameters' state, so every key is written by the one rank that owns it, and a load at another dp size reads each
parameter's state by name: these checkpoints reshard across dp. Another tp or pp size, or a directory that is not
such a checkpoint, is refused on every rank before any tensor is read. NxD's own rank-0 polling of the other ranks'
write results (``MAX_RETRY``) is DCP's collective here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshpar._compat import DTensor, local_tensor
from meshpar.checkpoint import CheckpointError, _run_dcp
from meshpar.compat.nxd.optimizer.zero_redundancy_optimizer import NeuronZero1Optimizer
from meshpar.failure import first_failure_on_any_rank, shared_refusal
from meshpar.parallel_dims import get_parallel

_GROUPS = "param_groups"


def _zero1_of(optimizer: Any) -> NeuronZero1Optimizer:
    """The ZeRO-1 optimizer itself, also inside NxD's trainer wrapper (``NxDOptimizer.optimizer``)."""
    inner = optimizer
    while not isinstance(inner, NeuronZero1Optimizer):
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            raise TypeError(
                f"zero_dcp_utils saves a NeuronZero1Optimizer's state (ZeRO-1); got {type(optimizer).__name__}"
            )
    return inner


def get_dcp_aux_infos(model: nn.Module, optim: Any) -> dict[str, Any]:
    """What the save and load need besides the state: the optimizer's parameters by position (``param_<i>`` in
    its state dict) and the model's name for each."""
    zero = _zero1_of(optim)
    params = [p for group in zero.param_groups for p in group["params"]]
    names = {id(p): name for name, p in model.named_parameters()}
    unnamed = [i for i, p in enumerate(params) if id(p) not in names]
    if unnamed:
        raise ValueError(f"get_dcp_aux_infos: optimizer parameters {unnamed[:10]} are not parameters of the model")
    return {
        "optim_pid_to_params": dict(enumerate(params)),
        "optim_pid_to_pnames": {i: names[id(p)] for i, p in enumerate(params)},
    }


def _tp_sharded(param: torch.Tensor) -> bool:
    if isinstance(param, DTensor):
        return any(p.is_shard() for p in param.placements)
    return bool(getattr(param, "tensor_model_parallel", False))


def _key(name: str, entry: str, tp_sharded: bool, dedup: bool) -> str:
    dims = get_parallel()
    key = f"state.{name}.{entry}"
    if dims.pp > 1:
        key += f"|pp-{dims.pp_rank:04d}"
    if dims.tp > 1 and (tp_sharded or not dedup):
        key += f"|tp-{dims.tp_rank:04d}"
    return key


def _entries(state: dict[str, Any], aux_infos: dict[str, Any], dedup: bool) -> Iterator[tuple[str, dict, str]]:
    """Each entry of ``state["state"]`` (keyed ``param_<i>``): its DCP key, the dict holding it and its name."""
    params, names = aux_infos["optim_pid_to_params"], aux_infos["optim_pid_to_pnames"]
    for pid_name, entries in state["state"].items():
        pid = int(pid_name.removeprefix("param_"))
        if pid not in names:
            raise ValueError(f"optimizer state entry {pid_name!r} has no parameter in aux_infos (another optimizer?)")
        for entry in entries:
            yield _key(names[pid], entry, _tp_sharded(params[pid]), dedup), entries, entry


def _flat(state: dict[str, Any], aux_infos: dict[str, Any], dedup: bool) -> dict[str, Any]:
    """``state["state"]`` as DCP keys -> this rank's tensors (the tensors themselves, so a load fills them in place)
    and its other values (an optimizer's step count kept as a Python number, as NxD's ``AdamW_FP32OptimParams``
    keeps it: DCP stores those as objects, and a load returns them in the dict it is given)."""
    return {
        key: local_tensor(entries[entry]) if torch.is_tensor(entries[entry]) else entries[entry]
        for key, entries, entry in _entries(state, aux_infos, dedup)
    }


def save_optim_state_dict(
    path: str, state_dict: dict[str, Any], aux_infos: dict[str, Any], dedup: bool = False
) -> dcp.Metadata | None:
    """Write this rank's ZeRO-1 state (``optimizer.state_dict()``, on any device) under ``path``; collective.
    Returns DCP's global metadata."""
    state = {**_flat(state_dict, aux_infos, dedup), _GROUPS: state_dict[_GROUPS]}
    # every rank enters before any rank creates the directory: a script may test whether it exists just before
    # (NxD's own ZeRO-1 DCP test does), and must get one answer on every rank
    dist.barrier()
    return _run_dcp(dcp.save, state, Path(path))


def _saved_size(keys: list[str], dim: str) -> int:
    ranks = [int(m.group(1)) for key in keys for m in [re.search(rf"\|{dim}-(\d{{4}})", key)] if m]
    return max(ranks) + 1 if ranks else 1


def _problem(path: str, requested: dict[str, torch.Tensor], groups_now: list[dict[str, Any]]) -> str | None:
    """Why this rank cannot load its entries from ``path`` (``None``: it can)."""
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (FileNotFoundError, OSError) as error:
        return f"{path} holds no DCP checkpoint ({error})"
    keys = [k for k in saved if k.startswith("state.")]
    dims = get_parallel()
    tp, pp = _saved_size(keys, "tp"), _saved_size(keys, "pp")
    if keys and (tp, pp) != (dims.tp, dims.pp):
        return (
            f"{path} was saved at tp {tp}, pp {pp}; this run is tp {dims.tp}, pp {dims.pp} (NxD's ZeRO-1 DCP "
            "format reshards across dp only; meshpar.checkpoint reshards across tp and pp too)"
        )
    missing = sorted(k for k in requested if k not in saved)
    if missing:
        return f"{path} lacks optimizer state {missing[:10]} (another model, or saved with another dedup)"
    wrong = [f"{k}: saved {tuple(saved[k].size)} vs {tuple(t.shape)}" for k, t in requested.items()
             if torch.is_tensor(t) and tuple(getattr(saved[k], "size", ())) != tuple(t.shape)]  # fmt: skip
    if wrong:
        return f"{path} does not fit this optimizer: {wrong[:10]}"
    groups = {k.split(".")[1] for k in saved if k.startswith(f"{_GROUPS}.")}  # DCP flattens the groups' options
    if len(groups) != len(groups_now):
        return f"{path} holds {len(groups)} parameter groups, this optimizer has {len(groups_now)}"
    return None


def load_optim_state_dict(path: str, optimizer: Any, aux_infos: dict[str, Any], dedup: bool = False) -> None:
    """Load what :func:`save_optim_state_dict` wrote into ``optimizer`` (at any dp size, the same tp and pp);
    collective. The state and the groups' options (an lr a scheduler set) are restored."""
    zero = _zero1_of(optimizer)
    zero.zero.init_state()
    template = zero.state_dict()
    flat = _flat(template, aux_infos, dedup)
    failed = first_failure_on_any_rank(_problem(path, flat, template[_GROUPS]))
    if failed is not None:
        rank, problem = failed
        raise shared_refusal(CheckpointError(f"load_optim_state_dict failed on rank {rank}: {problem}"))
    state = {**flat, _GROUPS: template[_GROUPS]}
    _run_dcp(dcp.load, state, Path(path))  # fills flat's tensors, the template's own, in place
    for key, entries, entry in _entries(template, aux_infos, dedup):
        if not torch.is_tensor(entries[entry]):  # objects (step counts) come back in the dict, not in place
            entries[entry] = state[key]
    zero.load_state_dict({"state": template["state"], _GROUPS: state[_GROUPS]})


__all__ = ["get_dcp_aux_infos", "load_optim_state_dict", "save_optim_state_dict"]
