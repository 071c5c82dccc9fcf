"""``neuronx_distributed.trainer.checkpoint``: NxD's ``save_checkpoint`` / ``load_checkpoint`` / ``has_checkpoint`` /
``finalize_checkpoint`` in NxD's directory layout, crash-safe.

``save_checkpoint(dir, tag, model=..., optimizer=..., scheduler=..., user_content=...)`` writes

    dir/tag/model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt    this rank's model shards (dp rank 0 of each replica set)
    dir/tag/optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt    the optimizer's (every dp rank with ZeRO-1, else dp rank 0)
    dir/tag/scheduler.pt, dir/tag/user_content.pt         from global rank 0
    dir/tag/done                                          written last, once every rank's files are in place
    dir/newest                                            the newest complete tag

Every file is written to a temporary name and renamed, and a tag counts only once its ``done`` marker exists, so a
save killed half way leaves the previous checkpoint as the newest one. Each file records the tp / pp / dp layout it
was written at. Under expert parallelism the model's and a plain optimizer's files are one per ep rank
(``dp_rank_00_ep_rank_ZZ_tp_rank_XX_pp_rank_YY.pt``, NxD's names), written by the first dp rank holding those
experts. A checkpoint loads at another dp size (the model and a plain optimizer's state come from dp rank 0;
a ZeRO-1 optimizer's, split by parameter over the saved dp ranks, is put back together from every saved dp rank's
file, or from ``optim/full_tp_rank_XX_pp_rank_YY.pt`` written by ``convert_zero_checkpoints``); another tp, pp
or ep size is refused on every rank (:mod:`meshpar.checkpoint` reshards those too).
``num_kept_ckpts`` keeps that many complete tags. With ``async_save=True`` (NxD's asynchronous saving)
``save_checkpoint`` returns once this rank's state is copied to host memory; one background thread per process
writes the files, and the tag becomes complete (its ``done`` marker, ``newest``, the pruning) when the next
``save_checkpoint``, ``load_checkpoint`` or ``finalize_checkpoint()`` finds every rank's writes ended (a write that
failed on any rank raises there on every rank, the tag left incomplete). NxD completes a pending save at interpreter
exit as well; here exit only waits for this rank's own writes (a collective at exit could hang on a rank already
gone) and warns that the tag stays incomplete: call ``finalize_checkpoint()`` before the end, as NxD's examples do.
``g_iostate`` is the process's :class:`CheckpointIOState` (created by the first save), ``is_interpreter_active``
NxD's flag, cleared at exit. A write that fails on one rank of a synchronous save raises on every rank too.
``use_xser`` / ``num_workers`` (Neuron's serialisation and its throttling) change nothing. With
``use_zero1_dcp=True`` a ZeRO-1 optimizer's state is written with DCP into ``dir/tag/optim/`` instead
(:mod:`meshpar.compat.nxd.optimizer.zero_dcp_utils`, keyed by the model's parameter names, so ``model`` must be
given; DCP's writes are collectives, made during the call even when saving asynchronously); a load passes the same
flag.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpar._compat import tree_map_only
from meshpar.compat.nxd import _xser
from meshpar.compat.nxd.modules.qkv_linear import kv_replica_mismatch
from meshpar.compat.nxd.optimizer import NeuronZero1Optimizer
from meshpar.compat.nxd.optimizer import zero_dcp_utils as dcp_utils
from meshpar.compat.nxd.optimizer.convert_zero_checkpoints import read_full_state
from meshpar.compat.nxd.optimizer.zero_redundancy_optimizer import zero1_rank
from meshpar.compat.nxd.parallel_layers.checkpointing import _agree, _into_model, _local
from meshpar.compat.nxd.trainer.model import NxDModel
from meshpar.compat.nxd.trainer.optimizer import NxDOptimizer
from meshpar.failure import first_failure_on_any_rank
from meshpar.parallel_dims import ParallelDims, get_parallel
from meshpar.pipeline.model import PipelineModel

logger = logging.getLogger(__name__)

_DONE = "done"
_NEWEST = "newest"


is_interpreter_active = True  # NxD's flag: False once the interpreter shuts down (see the module docstring)


@dataclass
class _Pending:
    """An asynchronous save whose files are being written."""

    writes: concurrent.futures.Future
    root: Path
    tag: str
    num_kept: int | None


class CheckpointIOState:
    """NxD's handle on this process's saves: an asynchronous one's background writes, completed by
    :meth:`wait_save` (see the module docstring)."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: _Pending | None = None

    def start(self, files: list[tuple[Path, Any]], root: Path, tag: str, num_kept: int | None) -> None:
        """Write ``files`` on the background thread; the tag completes at :meth:`wait_save`."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxd-save")
        future = self._executor.submit(_write_all, files)
        self._pending = _Pending(future, root, tag, num_kept)

    def wait_save(self) -> None:
        """Complete the pending asynchronous save, if any: every rank calls it (a collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.writes.result()
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        _raise_if_any_rank_failed(error, pending.root / pending.tag)
        _complete(pending.root, pending.tag, pending.num_kept)

    def wait_all(self) -> None:
        self.wait_save()

    def finalize_shutdown(self) -> None:
        """At interpreter exit: wait for this rank's own writes only (no collective), warning if a tag stays
        incomplete."""
        global is_interpreter_active
        is_interpreter_active = False
        pending, self._pending = self._pending, None
        if pending is None:
            return
        concurrent.futures.wait([pending.writes])
        logger.warning(
            "the asynchronous save of %s was not completed (call finalize_checkpoint() before exiting): it stays "
            "incomplete, the newest complete checkpoint is the one before",
            pending.root / pending.tag,
        )


g_iostate: CheckpointIOState | None = None


def _iostate(async_save: bool) -> CheckpointIOState:
    """NxD's ``g_iostate``: created by the first save, its exit hook registered then."""
    global g_iostate
    if g_iostate is None:
        g_iostate = CheckpointIOState(async_save)
        atexit.register(g_iostate.finalize_shutdown)
    g_iostate.async_save = async_save
    return g_iostate


def _write_all(files: list[tuple[Path, Any]]) -> None:
    for path, payload in files:
        _write(path, payload)


def _on_host(payload: Any) -> Any:
    """A copy of ``payload`` with every tensor in host memory (what an asynchronous save writes later)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), payload)


def _layout() -> dict[str, int]:
    dims = get_parallel()
    return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "ep": dims.ep}


def _file(kind: str, per_dp_rank: bool) -> str:
    """This rank's file of ``kind``: its own (ZeRO-1 state; named by its place in the sharding group, its dp rank at
    context-parallel size 1), else its replica set's, which under expert
    parallelism is one per ep rank (``_ep_rank_ZZ``, NxD's name: the dp ranks of an ep group hold different experts)."""
    dims = get_parallel()
    dp_rank = zero1_rank() if per_dp_rank else 0
    ep = f"_ep_rank_{dims.ep_rank:02d}" if dims.ep > 1 and not per_dp_rank else ""
    return f"{kind}/dp_rank_{dp_rank:02d}{ep}_tp_rank_{dims.tp_rank:02d}_pp_rank_{dims.pp_rank:02d}.pt"


def _writes_replica_files() -> bool:
    """Whether this rank writes its replica set's files: dp rank 0 of the ranks holding its experts (all of dp
    without expert parallelism), context-parallel rank 0 (the cp ranks of a dp rank hold the same state)."""
    dims = get_parallel()
    return dims.edp_mesh.get_local_rank() == 0 and dims.cp_rank == 0


def _write(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _complete_tags(root: Path) -> list[str]:
    """Complete tags, oldest first (by their ``done`` marker's time)."""
    if not root.is_dir():
        return []
    marked = [d for d in root.iterdir() if (d / _DONE).is_file()]
    return [d.name for d in sorted(marked, key=lambda d: ((d / _DONE).stat().st_mtime_ns, d.name))]


def has_checkpoint(checkpoint_dir_str: str) -> bool:
    return bool(_complete_tags(Path(checkpoint_dir_str)))


def _is_zero1(optimizer: Any, zero1_optimizer: bool) -> bool:
    if isinstance(optimizer, NxDOptimizer):
        return bool(optimizer.nxd_config["optimizer_config"]["zero_one_enabled"])
    if isinstance(optimizer, dict):
        return zero1_optimizer
    return isinstance(optimizer, NeuronZero1Optimizer)


def _dcp_aux_infos(model: Any, optimizer: Any) -> dict[str, Any]:
    """The names ``use_zero1_dcp`` keys the optimizer's state by (the same on every rank: a refusal is shared)."""
    if model is None or isinstance(model, dict) or isinstance(optimizer, dict):
        raise ValueError(
            "use_zero1_dcp=True needs the model and the ZeRO-1 optimizer themselves (the model's parameter names key "
            "the optimizer's state)"
        )
    return dcp_utils.get_dcp_aux_infos(model, optimizer)


def _model_state(model: Any) -> dict[str, Any]:
    if isinstance(model, dict):
        return model
    local = getattr(model, "local_state_dict", None)
    return local() if callable(local) else model.state_dict()


def save_checkpoint(
    checkpoint_dir_str: str,
    tag: str,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    num_workers: int = 8,
    use_xser: bool = False,
    num_kept_ckpts: int | None = None,
    async_save: bool = False,
    zero1_optimizer: bool = False,
    use_zero1_dcp: bool = False,
    avoid_saving_lower_precision_weights: bool = False,
) -> None:
    """Save under ``checkpoint_dir_str/tag`` (see the module docstring); every rank must call it."""
    if not dist.is_initialized():
        raise RuntimeError("save_checkpoint needs torch.distributed (NxD's checkpoints are per rank)")
    dims = get_parallel()
    iostate = _iostate(async_save)
    iostate.wait_save()  # a previous asynchronous save completes first
    root, tag = Path(checkpoint_dir_str), str(tag)
    directory = root / tag
    if dist.get_rank() == 0 and (directory / _DONE).exists():
        (directory / _DONE).unlink()  # overwriting a tag: it is incomplete until this save ends
    dist.barrier()
    layout = _layout()
    files: list[tuple[Path, Any]] = []  # this rank's, written now or (async_save) by the background thread
    if optimizer is not None:
        zero1 = _is_zero1(optimizer, zero1_optimizer)
        state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        if zero1 and use_zero1_dcp:
            _refuse_dcp_with_experts(dims)
            dcp_utils.save_optim_state_dict(str(directory / "optim"), state, _dcp_aux_infos(model, optimizer))
        elif zero1 or _writes_replica_files():
            files.append((directory / _file("optim", zero1), {"layout": layout, "state": _local(state)}))
    if model is not None and _writes_replica_files():
        files.append((directory / _file("model", False), {"layout": layout, "state": _local(_model_state(model))}))
    if dist.get_rank() == 0:
        if scheduler is not None:
            files.append((directory / "scheduler.pt", scheduler.state_dict()))
        if user_content is not None:
            files.append((directory / "user_content.pt", _local(user_content)))
    if async_save:
        iostate.start([(path, _on_host(payload)) for path, payload in files], root, tag, num_kept_ckpts)
        return
    try:
        _write_all(files)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    _raise_if_any_rank_failed(error, root / tag)
    _complete(root, tag, num_kept_ckpts)


def _raise_if_any_rank_failed(error: str | None, directory: Path) -> None:
    """Every rank raises if any rank's writes of ``directory`` failed (they are its own files)."""
    failed = first_failure_on_any_rank(error)
    if failed is not None:
        rank, first = failed
        raise RuntimeError(
            f"saving {directory} failed on rank {rank}: {first}; the tag stays incomplete (the newest complete "
            "checkpoint is unchanged)"
        )


def _complete(root: Path, tag: str, num_kept_ckpts: int | None) -> None:
    """Once every rank's files of ``root / tag`` are in place: its ``done`` marker, ``newest``, the pruning."""
    directory = root / tag
    dist.barrier()  # every rank's files are in place
    if dist.get_rank() == 0:
        (directory / _DONE).write_text(tag)
        newest = root / f".{_NEWEST}.tmp"
        newest.write_text(tag)
        os.replace(newest, root / _NEWEST)
        if num_kept_ckpts is not None:
            for old in _complete_tags(root)[: max(0, len(_complete_tags(root)) - num_kept_ckpts)]:
                if old != tag:
                    shutil.rmtree(root / old, ignore_errors=True)
    dist.barrier()


def _refuse_dcp_with_experts(dims: ParallelDims) -> None:
    if dims.ep > 1:  # the ep ranks' different experts share parameter names, which key the DCP state
        raise NotImplementedError(
            "use_zero1_dcp=True under expert parallelism is not provided (expert weights of different ep ranks share "
            "their names); save ZeRO-1 state without it"
        )


def _same_tp_pp(saved: dict[str, int] | None) -> bool:
    """Whether a file saved at ``saved`` loads here: the same tp, pp and ep sizes (files saved before the ep size
    was recorded are ep 1)."""
    now = _layout()
    return saved is not None and (saved["tp"], saved["pp"], saved.get("ep", 1)) == (now["tp"], now["pp"], now["ep"])


def _read(directory: Path, relative: str) -> tuple[str | None, Any]:
    """This rank's part: ``(None, state)``, or ``(why not, None)``. The dp size may differ from the save's."""
    error, state, _ = _read_part(directory, relative)
    return error, state


def _read_part(directory: Path, relative: str, *, bare_ok: bool = False, complete: bool = True) -> tuple[Any, ...]:
    """``(why not or None, state, bare)``. With ``bare_ok`` a file that is a bare state dict (written by NxD itself,
    also in torch_xla's split-tensor format, or by its checkpoint converter; they record no layout) is taken as it is
    (``bare``); a file meshpar wrote in a tag that never completed is refused (an interrupted save)."""
    file = directory / relative
    if not file.exists():
        return f"{file} does not exist (saved at another layout, or without this part)", None, False
    if _xser.is_xser_file(file):  # NxD's use_xser=True: torch_xla's split-tensor files, read without torch_xla
        payload = _xser.load(file, map_location=get_parallel().device)
    else:
        payload = torch.load(file, map_location=get_parallel().device, weights_only=False)
    if not (isinstance(payload, dict) and "layout" in payload and "state" in payload):
        if bare_ok:
            return None, payload, True
        return f"{file} records no layout (not written by this view's save_checkpoint)", None, False
    if not complete:
        return f"{directory} has no done marker: a save that did not finish", None, False
    if not _same_tp_pp(payload.get("layout")):
        return (
            (
                f"{file} was saved at {payload.get('layout')}, this run is {_layout()}; NxD-format checkpoints reshard "
                "across dp only (meshpar.checkpoint reshards across tp, pp and ep too)"
            ),
            None,
            False,
        )
    return None, payload["state"], False


def _unexpected_keys(model: Any, state: dict[str, Any]) -> str | None:
    """A bare state dict (no recorded layout) must fit the model: every key one it holds, even where ``strict`` is
    off (a key it lacks means another pp cut or another model, which loading would silently skip)."""
    if isinstance(model, dict):
        return None
    unexpected = sorted(set(state) - set(_model_state(model)))
    if unexpected:
        return (
            f"keys this rank's model does not hold: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} (a "
            "checkpoint cut for another tp / pp / ep layout, or for another model)"
        )
    return None


def merged_zero1_state(directory: Path, tp_rank: int, pp_rank: int) -> tuple[str | None, Any]:
    """This (tp, pp) rank's ZeRO-1 state with every parameter's entry, from the saved dp ranks' files (or the
    converter's full file): ``(None, state)`` or ``(why not, None)``."""
    dims = get_parallel()
    try:
        payload = read_full_state(directory / "optim", tp_rank, pp_rank, map_location=dims.device, ep_rank=dims.ep_rank)
    except (FileNotFoundError, ValueError) as error:
        return str(error), None
    if not _same_tp_pp(payload["layout"]):
        return f"{directory} was saved at tp / pp / ep {payload['layout']}, this run is {_layout()}", None
    return None, payload["state"]


def load_checkpoint(
    path: str,
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    num_workers: int = 8,
    strict: bool = True,
    use_zero1_dcp: bool = False,
) -> Any:
    """Load the complete tag ``tag`` (default: the newest) into what is given; returns the saved ``user_content``
    (``None`` if none was saved). A missing tag, part or layout mismatch is refused on every rank."""
    if not dist.is_initialized():
        raise RuntimeError("load_checkpoint needs torch.distributed (NxD's checkpoints are per rank)")
    if g_iostate is not None:  # a pending asynchronous save completes first (it may be the one asked for)
        g_iostate.wait_save()
    root = Path(path)
    tags = _complete_tags(root)
    error = None
    complete = True
    if tag is None:
        if not tags:
            error = f"no complete checkpoint under {root}"
        tag = tags[-1] if tags else ""
    elif str(tag) not in tags:
        # NxD loads a named tag without a done marker: its converter writes none. Only model files that are bare
        # state dicts (NxD's, the converter's) are taken from such a tag; meshpar's own files there are refused.
        complete = False
        if model is None or optimizer is not None or not (root / str(tag) / "model").is_dir():
            error = f"{root / str(tag)} is not a complete checkpoint (complete: {tags})"
    _agree(error, "load_checkpoint")
    directory = root / str(tag)
    if optimizer is not None and use_zero1_dcp and _is_zero1(optimizer, True):
        _refuse_dcp_with_experts(get_parallel())
        dcp_utils.load_optim_state_dict(str(directory / "optim"), optimizer, _dcp_aux_infos(model, optimizer))
    elif optimizer is not None:
        _load_optimizer(directory, optimizer)
    if model is not None:
        error, state, bare = _read_part(directory, _file("model", False), bare_ok=True, complete=complete)
        if error is not None and not complete:
            error = f"{directory} is not a complete checkpoint (complete: {tags}) nor NxD's bare model files: {error}"
        if error is None and bare:
            error = _unexpected_keys(model, state)
        if error is None:
            try:
                _load_model(model, state, strict)
            except (RuntimeError, KeyError, ValueError) as exc:
                error = f"loading the model: {exc}"
        _agree(error, "load_checkpoint")
        if not isinstance(model, dict):
            _agree(kv_replica_mismatch(_local_modules(model)), "load_checkpoint")
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
    content = directory / "user_content.pt"
    user_content = torch.load(content, map_location="cpu", weights_only=False) if content.exists() else None
    dist.barrier()
    return user_content


def _load_optimizer(directory: Path, optimizer: Any) -> None:
    """The optimizer's state from NxD's per-rank files (refused on every rank where any rank cannot load)."""
    zero1 = _is_zero1(optimizer, False) or (
        isinstance(optimizer, dict) and (directory / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt").exists()
    )
    if zero1 and not isinstance(optimizer, dict):  # an optimizer takes its own entries from the whole state
        dims = get_parallel()
        error, state = merged_zero1_state(directory, dims.tp_rank, dims.pp_rank)
    elif zero1:  # a dict gets this rank's file as saved
        error, state = _read(directory, _file("optim", True))
    else:
        error, state = _read(directory, _file("optim", False))
    if error is not None and (directory / "optim" / ".metadata").exists():
        error += " (its optimizer state was saved with use_zero1_dcp=True: load it with the same)"
    if error is None and not isinstance(optimizer, dict):
        try:
            optimizer.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            error = f"loading the optimizer state: {exc}"
    elif error is None:
        optimizer.clear()
        optimizer.update(state)
    _agree(error, "load_checkpoint")


def _load_model(model: Any, state: dict[str, Any], strict: bool) -> None:
    """``state`` (this rank's saved shards) into a dict, an ``NxDModel``, a pipeline's local stages or a module."""
    if isinstance(model, dict):
        model.clear()
        model.update(state)
    elif (stages := _pipeline_stages(model)) is not None:
        _load_local(stages, state, strict)
    else:
        _into_model(model, state, strict)


def _pipeline_stages(model: Any) -> list[torch.nn.Module] | None:
    """The stages this rank holds when ``model`` is a pipeline (an ``NxDModel`` with pp, or a ``PipelineModel``)."""
    if isinstance(model, NxDModel) and model.pp_enabled:
        return list(model.module.local_modules())
    if isinstance(model, PipelineModel):
        return list(model.local_modules())
    return None


def _local_modules(model: Any) -> list[torch.nn.Module]:
    """The modules this rank holds of an ``NxDModel``, a pipeline or a module."""
    stages = _pipeline_stages(model)
    return [model] if stages is None else stages


def _load_local(stages: list[torch.nn.Module], state_dict: dict[str, Any], strict: bool) -> None:
    """A rank's saved shards into its stages: each local stage takes its own keys (stages keep the model's FQNs);
    with ``strict`` every key must land (a shard of another partition is refused, not half loaded)."""
    used: set[str] = set()
    for stage in stages:
        held = stage.state_dict(keep_vars=True)
        own = {key: value for key, value in state_dict.items() if key in held}
        stage.load_state_dict(own, strict=strict)
        used |= own.keys()
    unused = sorted(set(state_dict) - used)
    if strict and unused:
        raise RuntimeError(f"keys that no local pipeline stage holds: {unused[:5]}")


def finalize_checkpoint() -> None:
    """Complete a pending asynchronous save (every rank calls it: a collective)."""
    if g_iostate is not None:
        g_iostate.wait_all()


__all__ = [
    "CheckpointIOState",
    "finalize_checkpoint",
    "g_iostate",
    "has_checkpoint",
    "is_interpreter_active",
    "load_checkpoint",
    "save_checkpoint",
]
