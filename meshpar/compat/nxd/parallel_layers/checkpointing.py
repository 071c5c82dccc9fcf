"""NxD's ``parallel_layers.save`` / ``load``: each (tp, pp) rank's shards in its own file, for the same layout.

``save({"model": model.state_dict(), "optimizer_state_dict": ..., "epoch": ...}, path)`` writes
``path/tp_rank_XX_pp_rank_YY/checkpoint.pt`` (dp rank 0 only, unless ``master_dp_only=False``), DTensors as their
local shards; under expert parallelism ``path/ep_rank_ZZ_tp_rank_XX_pp_rank_YY/`` from the first dp rank holding each
ep rank's experts. ``load(path, model, model_key="model")`` reads this rank's file, loads ``checkpoint[model_key]`` into
``model`` and returns the whole dict. The format does not reshard (NxD's does not either): a checkpoint written at
another tp / pp / ep is refused on every rank. For checkpoints that load into any layout use :mod:`meshpar.checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import DTensor, tree_map_only
from meshpar.failure import first_failure_on_any_rank
from meshpar.parallel_dims import ParallelDims, get_parallel

_FILE = "checkpoint.pt"

# NxD's environment switch to skip the barriers around its saves (saves here always end with one)
NXD_SKIP_RENDEZVOUS = "NXD_SKIP_RENDEZVOUS"

# NxD's type of a layer's ``preshard_hook(model_state_dict, prefix)``
PreShardHookFn = Callable[[nn.Module, dict, str], bool]


def ensure_directory_exists(filename: str | os.PathLike) -> None:
    """Create ``filename``'s directory if it does not exist."""
    Path(filename).parent.mkdir(parents=True, exist_ok=True)


def _preshard(module: nn.Module, state: dict[str, Any], prefix: str = "") -> None:
    if hasattr(module, "preshard_hook"):
        module.preshard_hook(state, prefix + "weight")
        return
    for name, child in module.named_children():
        _preshard(child, state, prefix + name + ".")


def get_sharded_model_dict(model: nn.Module, model_state_dict: dict[str, Any]) -> dict[str, Any]:
    """A full (dense) state dict turned, in place, into this tp rank's: each layer's ``preshard_hook`` pads what it
    pads, then every ``tensor_model_parallel`` tensor is cut to this rank's part (with its stride)."""
    from meshpar.compat.nxd.parallel_layers.layers import create_local_weight

    model = getattr(model, "original_torch_module", model)
    _preshard(model, model_state_dict)
    tp = get_parallel().tp
    for name, param in model.state_dict(keep_vars=True).items():
        if getattr(param, "tensor_model_parallel", False) and name in model_state_dict:
            if param.partition_dim not in (0, 1):
                raise ValueError(f"{name}: partition_dim {param.partition_dim}; NxD shards dims 0 and 1 only")
            full = model_state_dict[name]
            per_rank = full.shape[param.partition_dim] // tp
            model_state_dict[name] = create_local_weight(full, param.partition_dim, per_rank, param.partition_stride)
    return model_state_dict


def _rank_dir(path: str | os.PathLike, dims: ParallelDims, dp_rank: int | None) -> Path:
    """NxD's name of a rank's folder (or split-tensor object file): ``tp_rank_XX_pp_rank_YY``, ``_dp_rank_ZZ``
    after it for every dp rank's own (``master_dp_only=False``); meshpar's ``ep_rank_EE_`` before it under ep."""
    prefix = f"ep_rank_{dims.ep_rank:02d}_" if dims.ep > 1 else ""  # the dp ranks of an ep group hold other experts
    suffix = f"_dp_rank_{dp_rank:02d}" if dp_rank is not None else ""
    return Path(path) / f"{prefix}tp_rank_{dims.tp_rank:02d}_pp_rank_{dims.pp_rank:02d}{suffix}"


def _saved_layout(dims: ParallelDims) -> dict[str, int]:
    return {"tp": dims.tp, "pp": dims.pp, **({"ep": dims.ep} if dims.ep > 1 else {})}


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(item) for item in value)
    return value


def _down_cast(value: Any) -> Any:
    """Every fp32 tensor in ``value`` as bf16 (NxD's ``down_cast_bf16``)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(torch.bfloat16) if t.dtype == torch.float32 else t, value)


def save(
    checkpoint: dict[str, Any],
    output_dir: str | os.PathLike,
    save_serially: bool = True,
    save_xser: bool = False,
    down_cast_bf16: bool = False,
    master_dp_only: bool = True,
) -> None:
    """Write this rank's shards (atomically: a temporary file renamed into place), then wait for every rank.
    ``save_serially`` (NxD staggers the ranks' writes) changes nothing; ``save_xser`` writes torch_xla's split-tensor
    format as NxD does (the object file ``tp_rank_XX_pp_rank_YY`` and its ``.tensors`` folder: NxD on Neuron loads
    it; it records no layout, so a mismatch shows as keys or shapes the model does not have); ``down_cast_bf16``
    saves fp32 tensors as bf16."""
    dims = get_parallel()
    # cp rank 0 of dp rank 0 of the ranks holding these experts (the cp ranks of a dp rank hold the same state)
    if dims.cp_rank == 0 and (not master_dp_only or dims.edp_mesh.get_local_rank() == 0):
        directory = _rank_dir(output_dir, dims, None if master_dp_only else dims.dp_rank)
        local = _local(checkpoint)
        local = _down_cast(local) if down_cast_bf16 else local
        if save_xser:
            from meshpar.compat.nxd import _xser

            directory.parent.mkdir(parents=True, exist_ok=True)
            _xser.save(local, directory)
        else:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{_FILE}.tmp"
            torch.save({"layout": _saved_layout(dims), "checkpoint": local}, tmp)
            os.replace(tmp, directory / _FILE)
    dist.barrier()


def _agree(error: str | None, operation: str = "parallel_layers.load") -> None:
    """Every rank raises if any rank failed (each rank reads only its own file)."""
    failed = first_failure_on_any_rank(error)
    if failed is not None:
        rank, first = failed
        raise ValueError(f"{operation} failed on rank {rank}: {first}")


def _into_model(model: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> None:
    current = model.state_dict()
    converted = {}
    for name, tensor in state.items():
        target = current.get(name)
        if isinstance(target, DTensor):
            tensor = DTensor.from_local(
                tensor.to(target.device), target.device_mesh, target.placements, run_check=False
            )
        converted[name] = tensor
    model.load_state_dict(converted, strict=strict)


def _read(file: Path, dims: ParallelDims, weights_only: bool) -> tuple[str | None, Any, bool]:
    """``(why not, None, _)`` or ``(None, checkpoint, bare)``: a file :func:`save` wrote (its layout must be this
    run's), or one NxD wrote (``bare``: no layout recorded), plain or in torch_xla's split-tensor format."""
    from meshpar.compat.nxd import _xser

    if _xser.is_xser_file(file):
        return None, _xser.load(file, map_location=dims.device), True
    if not file.is_file():
        return f"{file} does not exist (saved with another tp / pp / ep, or not an NxD-format checkpoint)", None, False
    payload = torch.load(file, map_location=dims.device, weights_only=weights_only)
    if not (isinstance(payload, dict) and "layout" in payload and "checkpoint" in payload):
        return None, payload, True
    now = _saved_layout(dims)
    if payload["layout"] != now:
        return (
            (
                f"{file} was saved at {payload['layout']}, this run is {' '.join(f'{k}={v}' for k, v in now.items())}; "
                "this format does not reshard (use meshpar.checkpoint for that)"
            ),
            None,
            False,
        )
    return None, payload["checkpoint"], False


def _rank_file(chkpt_path: str | os.PathLike, dims: ParallelDims, master_dp_only: bool, load_xser: bool) -> Path:
    """This rank's file: ``tp_rank_XX_pp_rank_YY/checkpoint.pt`` (``..._dp_rank_ZZ`` without ``master_dp_only``;
    the per-dp-rank naming is tried too), or NxD's split-tensor object file ``tp_rank_XX_pp_rank_YY`` (first with
    ``load_xser``; found either way)."""
    from meshpar.compat.nxd import _xser

    names = [_rank_dir(chkpt_path, dims, None), _rank_dir(chkpt_path, dims, dims.dp_rank)]
    if not master_dp_only:
        names.reverse()
    plain = [name / _FILE for name in names]
    split = [name for name in names if _xser.is_xser_file(name)]
    candidates = split + plain if load_xser else plain + split
    return next((file for file in candidates if file.exists()), plain[0])


def load(
    chkpt_path: str | os.PathLike,
    model: nn.Module | None = None,
    model_or_optimizer: Any = None,
    model_key: str | None = "model",
    load_xser: bool = False,
    sharded: bool = True,
    strict: bool = True,
    master_dp_only: bool = True,
    weights_only: bool = False,
) -> dict[str, Any] | None:
    """Read this rank's file written by :func:`save` (or by NxD); with a model or optimizer (``model`` is NxD's
    older name for ``model_or_optimizer``), load ``checkpoint[model_key]`` (the whole checkpoint if ``model_key`` is
    None) into it. ``sharded=False``: ``chkpt_path`` is one full (unsharded) checkpoint file, cut to this rank's
    shards for the model. ``load_xser``: NxD's split-tensor files (read either way when found). Returns the
    checkpoint without the loaded entry, as NxD does (``None`` when the whole checkpoint was loaded)."""
    target = model_or_optimizer if model_or_optimizer is not None else model
    if not sharded and target is None:
        raise ValueError("load(sharded=False) needs model_or_optimizer: a full checkpoint is cut for a model")
    dims = get_parallel()
    file = Path(chkpt_path) if not sharded else _rank_file(chkpt_path, dims, master_dp_only, load_xser)
    error, checkpoint, bare = _read(file, dims, weights_only)
    if error is None and target is not None:
        state = checkpoint if model_key is None else checkpoint.get(model_key)
        unexpected = (
            sorted(set(state) - set(target.state_dict()))
            if bare and sharded and isinstance(state, dict) and isinstance(target, nn.Module)
            else []
        )
        if state is None:
            error = f"{file} has no key {model_key!r} (keys: {sorted(checkpoint)})"
        elif unexpected:  # no layout recorded: keys the model lacks mean another cut or model, never skipped
            error = f"{file} holds keys {type(target).__name__} does not: {unexpected[:5]}"
        else:
            try:
                if isinstance(target, torch.optim.Optimizer):
                    target.load_state_dict(state)
                else:
                    if not sharded:
                        state = get_sharded_model_dict(target, dict(state))
                    _into_model(target, state, strict)
            except (RuntimeError, KeyError, ValueError) as exc:
                error = f"loading {model_key!r} into {type(target).__name__}: {exc}"
    _agree(error)
    if isinstance(target, nn.Module):  # replicated kv heads of another layout load without a key mismatch
        from meshpar.compat.nxd.modules.qkv_linear import kv_replica_mismatch

        _agree(kv_replica_mismatch([target]))
    if target is None:
        return checkpoint
    if model_key is None:
        return None
    return {k: v for k, v in checkpoint.items() if k != model_key}
