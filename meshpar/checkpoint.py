"""Crash-safe distributed checkpoints with DCP, keyed by the original model FQNs, resharding across layouts.

Layout of a checkpoint root::

    root/step_00000010/        a complete checkpoint: DCP files + MANIFEST.json (file sizes and CRCs)
    root/step_00000010.<id>/   a newer copy of the same step (a re-save), until the older copy is retired
    root/latest                the name of the newest complete checkpoint (replaced atomically)
    root/.tmp-step_...-<id>/   a save in progress (ignored by load; left behind by a crash, removed by the next save)

A save writes and fsyncs a temporary directory, then rank 0 writes the manifest, renames the directory into place
beside any older copy of the step, points ``latest`` at it and only then removes older copies, so a crash (even
``kill -9`` of a rank at any instruction, during a re-save of the same step too) never harms the last complete
checkpoint. ``load`` checks the manifest (every file present, sizes and CRCs equal) on rank 0 and checks the
model's keys and shapes against the checkpoint's metadata on every rank *before* DCP runs, so a corrupt, incomplete
or mismatched checkpoint raises the same clear error on all ranks instead of hanging.

Model tensors are saved as ``model.<fqn>``: DTensors keep their placements, so a checkpoint written at
(tp=2, pp=2) loads at (tp=4, pp=1), (tp=1, pp=2, dp=2) or on one process. Optimizer state comes from
:class:`meshpar.DistributedOptimizer` (FQN-keyed, resharding too). RNG states are per rank and restored only when the
world size is unchanged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshpar._compat import DTensor, add_dcp_aliases, local_tensor
from meshpar._fqn import checkpoint_modules, tied_of
from meshpar._shards import local_slice
from meshpar._stored_layout import Layout, stored_as, stored_shape
from meshpar.failure import collective_phase, first_failure_on_any_rank, shared_refusal
from meshpar.optim import DistributedOptimizer
from meshpar.random import get_rng_tracker

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: missing, incomplete, corrupt, or not fitting the model or
    optimizer. DCP's own ``CheckpointException`` (a ``BaseException``) arrives wrapped in this ``Exception``."""


def _run_dcp(operation: Any, state: dict[str, Any], path: Path) -> Any:
    try:
        return operation(state, checkpoint_id=str(path))
    except CheckpointException as error:
        # DCP gathers every rank's failure and raises CheckpointException on all ranks: the job stays usable
        raise shared_refusal(CheckpointError(f"DCP {operation.__name__} of {path} failed: {error}")) from error


def _on_rank0(action: Callable[[], Any]) -> Any:
    """Run ``action`` on rank 0 and hand every rank its result; if it raised, every rank raises it as a
    :class:`CheckpointError` (file operations fail on the rank that does them; the others must not go on alone)."""
    outcome: tuple[Any, str | None] = (None, None)
    if _rank() == 0:
        try:
            outcome = (action(), None)
        except CheckpointError as error:
            outcome = (None, str(error))
        except Exception as error:
            outcome = (None, f"{type(error).__name__}: {error}")
    result, problem = _broadcast(outcome)
    if problem is not None:
        raise shared_refusal(CheckpointError(problem))
    return result


def model_state_dict(
    model: nn.Module | Sequence[nn.Module], tied: dict[str, str] | None = None, *, for_load: bool = False
) -> dict[str, torch.Tensor]:
    """FQN -> tensor over all local modules (pipeline stages hold disjoint FQNs).

    ``tied`` maps a tied parameter to the one it shares values with (``{"lm_head.weight": "transformer.wte.weight"}``):
    only the source is saved, and on load a stage holding just the alias (the last pipeline stage) reads the source.
    """
    state: dict[str, torch.Tensor] = {}
    for module in checkpoint_modules(model):
        state.update(module.state_dict())
    for alias, source in (tied or {}).items():
        if alias in state:
            tensor = state.pop(alias)
            if for_load and source not in state:
                state[source] = tensor
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    for name, value in get_rng_tracker().get_states().items():
        state[f"tracker.{name}"] = value
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = {k.removeprefix("tracker."): v for k, v in state.items() if k.startswith("tracker.")}
    if tracker:
        get_rng_tracker().set_states(tracker)


def _full_state(
    model: nn.Module | Sequence[nn.Module],
    optimizer: DistributedOptimizer | None,
    scheduler: Any,
    tied: dict[str, str] | None = None,
    for_load: bool = False,
) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model_state_dict(model, tied, for_load=for_load)}
    if optimizer is not None:
        state["optim"], _ = _fold_tied_optimizer_state(optimizer.state_dict(), tied, for_load)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state[f"rng_rank{_rank()}_of{_world()}"] = _rng_state()
    return state


Aliases = dict[str, tuple[str, dict[str, Any]]]


def _model_shapes(model: nn.Module | Sequence[nn.Module]) -> dict[str, Layout]:
    """FQN -> the model's own shape (or :class:`meshpar._stored_layout.GroupedRows`), for every parameter meshpar
    keeps in another shape: a module that does says so in ``checkpoint_shapes`` (its parameter name -> shape or
    layout; packed parameters such as GPT-2's fused QKV or Phi-3's grouped-query ``qkv_proj``)."""
    shapes = {}
    for module in checkpoint_modules(model):
        for prefix, sub in module.named_modules():
            for name, layout in getattr(sub, "checkpoint_shapes", {}).items():
                param = sub._parameters.get(name)
                if param is not None and tuple(param.shape) != stored_shape(layout):
                    shapes[f"{prefix}.{name}" if prefix else name] = layout
    return shapes


def in_model_shapes(state: dict[str, Any], model: nn.Module | Sequence[nn.Module], *, for_load: bool) -> dict[str, Any]:
    """``state`` as DCP should see it: packed parameters and their optimizer state in the model's own shapes
    (:mod:`meshpar._stored_layout`), so torch's tools and a plain model read the checkpoint. A shallow copy; with
    ``for_load`` the stand-ins are views, so DCP's in-place load fills ``state``'s own tensors."""
    shapes = _model_shapes(model)
    if not shapes:
        return state

    def stored(value: Any, layout: Layout) -> Any:
        shape = stored_shape(layout)
        if torch.is_tensor(value) and value.dim() == len(shape) + 1 and value.numel() == math.prod(shape):
            return stored_as(value, layout, for_load=for_load)
        return value

    out = dict(state)
    out["model"] = {k: stored(v, shapes[k]) if k in shapes else v for k, v in state["model"].items()}
    if "optim" in state:
        entries = state["optim"]["state"]
        out["optim"] = {
            **state["optim"],
            "state": {
                fqn: {k: stored(v, shapes[fqn]) for k, v in entry.items()} if fqn in shapes else entry
                for fqn, entry in entries.items()
            },
        }
    return out


def _fold_tied_optimizer_state(
    state: dict[str, Any], tied: dict[str, str] | None, for_load: bool
) -> tuple[dict[str, Any], Aliases]:
    """Tied parameters' optimizer state is stored once, under the source's FQN, as their values are.

    Under pp the first and last stage hold separate copies of a tied weight (the embedding and the LM head) with the
    same grads and steps, so the same state. On save the alias's entry is dropped; on load a rank that holds the
    alias without the source reads the source's entry into it, and :func:`_unfold_tied_optimizer_state` puts it
    back under the alias (returned: alias -> (source, the alias's entry))."""
    entries, aliases = state["state"], {}
    for alias, source in (tied or {}).items():
        if alias in entries:
            entry = entries.pop(alias)
            if for_load:
                entries.setdefault(source, entry)
                aliases[alias] = (source, entry)
    return state, aliases


@torch.no_grad()
def _unfold_tied_optimizer_state(state: dict[str, Any], aliases: Aliases) -> dict[str, Any]:
    entries = state["state"]
    for alias, (source, entry) in aliases.items():
        if entries[source] is entry:
            del entries[source]
        else:  # this rank holds both copies: the alias takes the loaded values of the source
            for key, value in entry.items():
                if torch.is_tensor(value):
                    value.copy_(entries[source][key])
        entries[alias] = entry
    return state


def _versions(root: Path, step: int) -> list[Path]:
    """Every directory holding a save of ``step``: re-saving a step writes a new version beside the old one."""
    name = _step_name(step)
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and (p.name == name or p.name.startswith(name + "."))]


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _check_path(value: Any, what: str) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__}")


def _check_modules(model: Any) -> None:
    modules = [model] if isinstance(model, nn.Module) else model
    if not isinstance(modules, Sequence) or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            f"model must be an nn.Module or a sequence of them (a parallel model's local_modules()), got "
            f"{type(model).__name__}; pass the module itself, not its state_dict()"
        )


def _check_save_arguments(
    directory: Any, model: Any, optimizer: Any, step: Any, extra: Any, scheduler: Any, tied: Any
) -> None:
    """What ``save`` refuses before anything collective happens (on every rank alike, see ``collective_phase``)."""
    _check_path(directory, "directory")
    _check_modules(model)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"step must be a non-negative int, got {step!r}")
    if optimizer is not None and not callable(getattr(optimizer, "state_dict", None)):
        raise TypeError(f"optimizer must be a meshpar.DistributedOptimizer or None, got {type(optimizer).__name__}")
    try:
        json.dumps(extra or {})
    except (TypeError, ValueError) as error:
        raise TypeError(f"extra must be JSON-serialisable: {error}") from error


@collective_phase("checkpoint.save", validate=_check_save_arguments)
def save(
    directory: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: DistributedOptimizer | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    scheduler: Any = None,
    tied: dict[str, str] | None = None,
) -> Path:
    """Save a complete checkpoint ``directory/step_<step>`` and point ``latest`` at it; collective.

    Crash-safe at every instruction, a re-save of the same step included: the new copy is written and fsynced in a
    temporary directory, placed beside any older copy of the step (``step_<step>.<id>``), ``latest`` flips to it,
    and only then are older copies of the step removed; leftovers of a crashed save are removed by the next one.
    ``extra`` must be JSON-serialisable (data-loader position, config, ...). Wrong arguments and a file operation
    that fails on rank 0 are refused on every rank alike, and the job stays usable.
    """
    root = Path(directory)
    tmp_name, final_name = _on_rank0(lambda: _start_save(root, step))
    tmp, final = root / tmp_name, root / final_name
    tied = tied_of(model, tied)
    state = _full_state(model, optimizer, scheduler, tied)
    # extra is stored as one JSON string: DCP would flatten a dict into keys the loader cannot know in advance
    state["meta"] = {"step": step, "extra": json.dumps(extra or {}), "world_size": _world()}
    _run_dcp(dcp.save, in_model_shapes(state, model, for_load=False), tmp)
    _barrier()
    _on_rank0(lambda: _place(root, tmp, final, step, tied))  # every rank returns once the copy is in place
    return final


def _start_save(root: Path, step: int) -> tuple[str, str]:
    """Rank 0: clear what crashed saves left and create this save's temporary directory; its (temporary, final)
    names."""
    for leftover in root.glob(".tmp-step_*"):  # an earlier save that crashed before placing its copy
        shutil.rmtree(leftover, ignore_errors=True)
    tmp_name, final_name = _new_names(root, step)
    (root / tmp_name).mkdir(parents=True)
    return tmp_name, final_name


def _place(root: Path, tmp: Path, final: Path, step: int, tied: dict[str, str] | None) -> None:
    """Rank 0, once every rank has written: tied names as aliases of their stored source (a plain ``dcp.load`` of
    the model's full state dict finds both), manifest, rename into place, flip ``latest``, retire older copies."""
    add_dcp_aliases(str(tmp), {f"model.{alias}": f"model.{source}" for alias, source in (tied or {}).items()})
    _fsync_files(tmp)
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    manifest = {"step": step, "files": {p.name: {"size": p.stat().st_size, "crc32": _crc(p)} for p in files}}
    _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name)
    for older in _versions(root, step):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)


def _new_names(root: Path, step: int) -> tuple[str, str]:
    """(temporary, final) directory names for a save of ``step``: the final name is new even on a re-save."""
    unique = uuid.uuid4().hex[:8]
    name = _step_name(step)
    return f".tmp-{name}-{unique}", name if not (root / name).exists() else f"{name}.{unique}"


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    root = Path(directory)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    return root / pointer.read_text().strip()


def _resolve(directory: str | os.PathLike, step: int | None) -> Path | None:
    """The checkpoint to load: ``directory`` itself when it is one (what :func:`save` returns), else ``latest`` or
    the newest complete copy of ``step``."""
    root = Path(directory)
    if (root / MANIFEST).exists():
        return root
    if step is None:
        return latest_checkpoint(root)
    latest = latest_checkpoint(root)
    versions = _versions(root, step)
    if latest in versions:
        return latest
    complete = [p for p in versions if (p / MANIFEST).exists()]
    return max(complete, key=lambda p: p.stat().st_mtime) if complete else root / _step_name(step)


def _verify_manifest(path: Path) -> str | None:
    """What is wrong with the checkpoint at ``path`` (``None``: complete and intact). Never raises, so that the
    rank that checks can hand every rank the same answer."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        return f"checkpoint {path} does not exist"
    if not manifest_path.exists():
        return f"checkpoint {path} is incomplete (no {MANIFEST}); it was not finished"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        for name, info in files.items():
            file = path / name
            if not file.exists():
                return f"checkpoint {path} is missing file {name}"
            if file.stat().st_size != info["size"] or _crc(file) != info["crc32"]:
                return f"checkpoint {path} is corrupt: {name} does not match its recorded size/CRC"
    except json.JSONDecodeError as error:
        return f"checkpoint {path} has a corrupt {MANIFEST}: {error}"
    except (KeyError, TypeError, AttributeError, OSError) as error:
        return f"checkpoint {path} has a malformed {MANIFEST} ({type(error).__name__}: {error})"
    return None


def _mismatches(saved: dict[str, Any], requested: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(requested keys the checkpoint lacks, ``key: checkpoint shape vs requested shape`` for tensors)."""
    missing = sorted(k for k in requested if k not in saved)
    wrong = [
        f"{k}: checkpoint {tuple(saved[k].size)} vs model {tuple(t.shape)}"
        for k, t in requested.items()
        if k in saved and torch.is_tensor(t) and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(t.shape)
    ]
    return missing, wrong


def _listed(keys: list[str]) -> str:
    return f"{keys[:10]}{' ...' if len(keys) > 10 else ''}"


def _optimizer_keys(optim: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint keys of an optimizer's per-parameter state (DCP flattens nested dicts with dots)."""
    return {f"state.{fqn}.{key}": value for fqn, entry in optim["state"].items() for key, value in entry.items()}


def _check_keys(
    path: Path,
    metadata: dict[str, Any],
    model: dict[str, torch.Tensor],
    optim: dict[str, Any] | None,
    tied: dict[str, str] | None = None,
) -> None:
    """Compare the model tensors (and optimizer state) this rank asks for, and all ranks' model keys together,
    with the checkpoint's, before DCP runs: every rank raises the same clear error instead of DCP failing inside a
    collective on some ranks."""
    saved = {k.removeprefix("model."): v for k, v in metadata.items() if k.startswith("model.")}
    problems = []
    missing, wrong = _mismatches(saved, model)
    if missing:
        problems.append(f"missing keys {_listed(missing)}")
    if wrong:
        problems.append(f"shape mismatches {wrong[:10]}")
    everyone: list[set[str]] = [set(model)]
    if dist.is_initialized():
        everyone = [set()] * _world()
        dist.all_gather_object(everyone, set(model))
    # tied names stored as aliases of their source (see _place) are not unexpected when the model folds them
    unexpected = sorted(set(saved) - set().union(*everyone) - set(tied or {}))
    if unexpected:
        problems.append(f"unexpected keys {_listed(unexpected)}")
    if optim is not None:
        saved_optim = {k.removeprefix("optim."): v for k, v in metadata.items() if k.startswith("optim.")}
        if not any(k.startswith("state.") for k in saved_optim) and optim["state"]:
            problems.append("no optimizer state (it was saved without an optimizer)")
        else:
            missing, wrong = _mismatches(saved_optim, _optimizer_keys(optim))
            if missing:
                problems.append(f"missing optimizer state {_listed([k.removeprefix('state.') for k in missing])}")
            if wrong:
                problems.append(f"optimizer state shape mismatches {wrong[:10]}")
    # a rank whose own keys fit must not enter DCP while another refuses
    failed = first_failure_on_any_rank("; ".join(problems) if problems else None)
    if failed is not None:
        rank, found = failed
        raise shared_refusal(CheckpointError(f"checkpoint {path} does not fit this model (rank {rank}): {found}"))


def _check_load_arguments(directory: Any, model: Any, optimizer: Any, step: Any, scheduler: Any, tied: Any) -> None:
    _check_path(directory, "directory")
    _check_modules(model)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None (latest), got {step!r}")
    if optimizer is not None and not callable(getattr(optimizer, "load_state_dict", None)):
        raise TypeError(f"optimizer must be a meshpar.DistributedOptimizer or None, got {type(optimizer).__name__}")


def _verified(directory: str | os.PathLike, step: int | None) -> Path:
    """Rank 0: the checkpoint to load, complete and intact, or the :class:`CheckpointError` saying why not."""
    path = _resolve(directory, step)
    if path is None:
        raise CheckpointError(f"no complete checkpoint in {directory} (no '{LATEST}' pointer)")
    problem = _verify_manifest(path)
    if problem:
        raise CheckpointError(problem)
    return path


@collective_phase("checkpoint.load", validate=_check_load_arguments)
def load(
    directory: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: DistributedOptimizer | None = None,
    *,
    step: int | None = None,
    scheduler: Any = None,
    tied: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint of ``step`` (default: ``latest``) into ``model`` / ``optimizer`` in any layout; returns
    ``{"step": ..., "extra": ...}``. Collective. A checkpoint that is missing, incomplete, corrupt or does not fit
    is refused on every rank alike before DCP runs, and the job stays usable (catch the error, load another step)."""
    path = _on_rank0(lambda: _verified(directory, step))
    tied = tied_of(model, tied)
    state = _full_state(model, None, scheduler, tied, for_load=True)
    aliases: Aliases = {}
    if optimizer is not None:
        optimizer.init_state()
        state["optim"], aliases = _fold_tied_optimizer_state(optimizer.state_dict(), tied, for_load=True)
    unpacked_optim = state.get("optim")
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rng_key = next(k for k in state if k.startswith("rng_rank"))
    if not any(k.startswith(rng_key + ".") for k in metadata):
        del state[rng_key]  # a different world size: RNG streams cannot be mapped
    state["meta"] = {"step": 0, "extra": "{}", "world_size": 0}
    # packed parameters as views in the model's shapes: DCP loads in place, through them, into state's tensors
    state = in_model_shapes(state, model, for_load=True)
    _check_keys(path, metadata, state["model"], state.get("optim"), tied)
    _run_dcp(dcp.load, state, path)
    if optimizer is not None:
        optimizer.load_state_dict(_unfold_tied_optimizer_state(unpacked_optim, aliases))
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if rng_key in state:
        _set_rng_state(state[rng_key])
    return {"step": state["meta"]["step"], "extra": json.loads(state["meta"]["extra"])}


def consolidated_state(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint, whole, on this one process (no mesh): the one merge of meshpar's exports."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = Path(checkpoint)
    problem = _verify_manifest(source)
    if problem:
        raise CheckpointError(problem)
    with tempfile.TemporaryDirectory() as scratch:
        torch_file = Path(scratch) / "consolidated.pt"
        dcp_to_torch_save(str(source), str(torch_file))
        full = torch.load(torch_file, weights_only=False)
    return {k: v.contiguous() for k, v in full["model"].items()}


def export_consolidated(
    checkpoint: str | os.PathLike, output_dir: str | os.PathLike, config: dict[str, Any] | None = None
) -> Path:
    """Merge a checkpoint into ``output_dir/model.safetensors`` (+ ``config.json``), on one process, no mesh."""
    from safetensors.torch import save_file

    tensors = consolidated_state(checkpoint)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_untied(save_file, tensors, out / "model.safetensors")
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _save_untied(save_file: Any, tensors: dict[str, torch.Tensor], path: Path) -> None:
    seen: dict[int, str] = {}
    unique = {}
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        unique[name] = tensor.clone() if ptr in seen else tensor
        seen[ptr] = name
    save_file(unique, str(path))


@torch.no_grad()
def load_consolidated(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    strict: bool = True,
    *,
    reshape: bool = False,
    tied: dict[str, str] | None = None,
) -> None:
    """Load ``model.safetensors`` (a file or a directory holding it) into any layout: each rank keeps its slice.

    ``reshape`` accepts a file tensor of another shape with the same number of elements (HF's ``[in, 3 * hidden]``
    fused QKV for meshpar's layout-independent ``[in, 3, hidden]``). ``tied`` (alias -> source) fills a tied
    parameter the file stores once (HF drops ``lm_head.weight``) from its source, e.g. on the last pipeline stage.
    """
    from safetensors.torch import load_file

    file = Path(path)
    file = file / "model.safetensors" if file.is_dir() else file
    full = load_file(str(file))
    for alias, source in (tied or {}).items():
        if alias not in full and source in full:
            full[alias] = full[source]
    state = model_state_dict(model)
    missing = sorted(set(state) - set(full))
    if strict and missing:
        raise CheckpointError(f"{file} lacks keys {missing[:10]}")
    for name, target in state.items():
        if name not in full:
            continue
        source = full[name]
        if tuple(source.shape) != tuple(target.shape):
            if not (reshape and source.numel() == target.numel()):
                raise CheckpointError(f"{name}: file has shape {tuple(source.shape)}, model {tuple(target.shape)}")
            source = source.reshape(target.shape)
        if isinstance(target, DTensor):
            local_tensor(target).copy_(local_slice(source, target))
        else:
            target.copy_(source)
