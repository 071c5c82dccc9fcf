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

from meshpar._compat import DTensor
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
    prefix = f"dp_rank_{dp_rank:02d}_" if dp_rank is not None else ""
    if dims.ep > 1:  # the dp ranks of an ep group hold different experts
        prefix += f"ep_rank_{dims.ep_rank:02d}_"
    return Path(path) / f"{prefix}tp_rank_{dims.tp_rank:02d}_pp_rank_{dims.pp_rank:02d}"


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


def save(checkpoint: dict[str, Any], output_dir: str | os.PathLike, master_dp_only: bool = True) -> None:
    """Write this rank's shards (atomically: a temporary file renamed into place), then wait for every rank."""
    dims = get_parallel()
    if not master_dp_only or dims.edp_mesh.get_local_rank() == 0:  # dp rank 0 of the ranks holding these experts
        directory = _rank_dir(output_dir, dims, None if master_dp_only else dims.dp_rank)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"layout": _saved_layout(dims), "checkpoint": _local(checkpoint)}
        tmp = directory / f".{_FILE}.tmp"
        torch.save(payload, tmp)
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


def load(
    chkpt_path: str | os.PathLike,
    model: nn.Module | None = None,
    model_key: str | None = "model",
    strict: bool = True,
) -> dict[str, Any]:
    """Read this rank's file written by :func:`save`; with ``model``, load ``checkpoint[model_key]`` (the whole
    checkpoint if ``model_key`` is None) into it. Returns the checkpoint dict."""
    dims = get_parallel()
    file = _rank_dir(chkpt_path, dims, None) / _FILE
    if not file.exists():
        file = _rank_dir(chkpt_path, dims, dims.dp_rank) / _FILE
    error, checkpoint = None, None
    if not file.exists():
        error = f"{file} does not exist (saved with another tp / pp / ep, or not an NxD-format checkpoint)"
    else:
        payload = torch.load(file, map_location=dims.device, weights_only=False)
        saved = payload.get("layout", {}) if isinstance(payload, dict) else {}
        now = _saved_layout(dims)
        if saved != now:
            error = (
                f"{file} was saved at {saved or 'an unknown layout'}, this run is "
                f"{' '.join(f'{k}={v}' for k, v in now.items())}; this format does not reshard (use meshpar.checkpoint "
                "for that)"
            )
        else:
            checkpoint = payload["checkpoint"]
            if model is not None:
                state = checkpoint if model_key is None else checkpoint.get(model_key)
                if state is None:
                    error = f"{file} has no key {model_key!r} (keys: {sorted(checkpoint)})"
                else:
                    try:
                        _into_model(model, state, strict)
                    except (RuntimeError, KeyError, ValueError) as exc:
                        error = f"loading {model_key!r} into {type(model).__name__}: {exc}"
    _agree(error)
    return checkpoint
