"""``apex.transformer.pipeline_parallel.utils``: apex's microbatch calculator (the view's own state, as apex keeps it
in this module), microbatch slicing, model unwrapping and the loss / norm helpers.

The calculator is set by :func:`setup_microbatch_calculator` (again by ``_reconfigure_microbatch_calculator``, apex's
test hook; meshpar's setup replaces an earlier one too, where apex asserts) and read by the schedules when they are
not given ``num_microbatches``; it outlives :func:`meshpar.compat.apex.parallel_state.destroy_model_parallel`, as in
apex. apex's named wall-clock timers (:func:`get_timers`) exist once ``_set_timers()`` made them, as in apex.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.compat.apex.enums import ModelType
from meshpar.parallel_dims import get_parallel
from meshpar.pipeline.microbatches import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
    split_microbatches,
)

Shape = Sequence[int] | torch.Size

_calculator_state: NumMicroBatchesCalculator | None = None


def setup_microbatch_calculator(
    rank: int,
    rampup_batch_size: Sequence[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """A constant count, or Megatron's batch-size ramp-up (``rampup_batch_size=[start, increment, samples]``, moved on
    by :func:`update_num_microbatches`)."""
    global _calculator_state
    _calculator_state = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size
    )


def _reconfigure_microbatch_calculator(
    rank: int,
    rampup_batch_size: Sequence[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """apex's hook for tests: replace the calculator (warns on rank 0, as apex does)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn("_reconfigure_microbatch_calculator is only meant for tests", stacklevel=2)
    setup_microbatch_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


def _calculator() -> NumMicroBatchesCalculator:
    if _calculator_state is None:
        raise RuntimeError(
            "no microbatch calculator: call setup_microbatch_calculator(rank, None, global_batch_size, "
            "micro_batch_size, data_parallel_size) first, or pass num_microbatches= to the schedule"
        )
    return _calculator_state


def get_num_microbatches() -> int:
    return _calculator().get()


def get_micro_batch_size() -> int:
    return _calculator().micro_batch_size


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    """Move a ramp-up on to ``consumed_samples`` (a constant count stays)."""
    _calculator().update(consumed_samples, consistency_check)


def listify_model(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return model if isinstance(model, list) else [model]


def _split_batch_into_microbatch(
    batch: Sequence[torch.Tensor],
    *,
    _micro_batch_size: int | None = None,
    _global_batch_size: int | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Successive ``micro_batch_size``-row slices of every tensor of ``batch`` (sizes default to the calculator's)."""
    mbs = _micro_batch_size if _micro_batch_size is not None else get_micro_batch_size()
    total = _global_batch_size if _global_batch_size is not None else get_current_global_batch_size()
    for start in range(0, total, mbs):
        yield [x[start : start + mbs] for x in batch]


def get_kth_microbatch(batch: Any, k: int, micro_batch_size: int | None = None) -> Any:
    """Rows ``[k * mbs, (k + 1) * mbs)`` of every tensor of a list / tuple (or dict) batch; anything else as it is.
    ``micro_batch_size`` defaults to the calculator's."""
    if batch is None or not isinstance(batch, (list, tuple, dict)):
        return batch
    mbs = micro_batch_size if micro_batch_size is not None else get_micro_batch_size()
    start, end = k * mbs, (k + 1) * mbs
    for x in batch.values() if isinstance(batch, dict) else batch:
        if torch.is_tensor(x) and x.size(0) < end:
            raise ValueError(f"microbatch {k} needs rows [{start}, {end}) but the batch has {x.size(0)}")
    if isinstance(batch, dict):
        return {name: x[start:end] if torch.is_tensor(x) else x for name, x in batch.items()}
    return [x[start:end] if torch.is_tensor(x) else x for x in batch]


def _split_batch(batch: Any, num_microbatches: int | None) -> list[Any]:
    """The schedules' microbatches of apex's ``batch`` (the whole minibatch as a list / tuple / dict of tensors, split
    along dim 0; anything else handed to every step). ``num_microbatches=None``: the calculator's count, and its
    ``micro_batch_size`` must be the rows each microbatch gets."""
    m = num_microbatches if num_microbatches is not None else get_num_microbatches()
    if isinstance(batch, (list, tuple)):
        odd = sorted({type(x).__name__ for x in batch if x is not None and not torch.is_tensor(x)})
        if odd:
            raise TypeError(
                f"apex's batch is the minibatch as a list/tuple of tensors (split into microbatches by the schedule), "
                f"but it holds {odd}; pass per-microbatch data through an iterator or another object the "
                "forward_step_func reads from"
            )
    microbatches = split_microbatches(batch, m)
    if num_microbatches is None and isinstance(batch, (list, tuple, dict)):
        rows = {x.shape[0] for x in (batch.values() if isinstance(batch, dict) else batch) if torch.is_tensor(x)}
        mbs = get_micro_batch_size()
        if rows and rows.pop() != m * mbs:
            raise ValueError(
                f"the batch does not hold the {m * mbs} rows the microbatch calculator expects ({m} microbatches of "
                f"micro_batch_size={mbs})"
            )
    return microbatches


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    if not dist.is_initialized() or is_last_rank():
        print(message, flush=True)


def param_is_not_shared(param: nn.Parameter) -> bool:
    """apex's helper, kept to its letter: it returns the parameter's ``shared`` flag (``False`` when unset)."""
    return getattr(param, "shared", False)


def unwrap_model(model: Any, module_instances: tuple[type, ...] | None = None) -> Any:
    """The module(s) inside data-parallel wrappers (torch DDP and :func:`build_model`'s chunks by default)."""
    from meshpar.compat.apex.pipeline_parallel.schedules.common import DataParallelChunk

    wrappers = module_instances or (nn.parallel.DistributedDataParallel, DataParallelChunk)
    models = model if isinstance(model, list) else [model]
    unwrapped = []
    for module in models:
        while isinstance(module, wrappers):
            module = module.module
        unwrapped.append(module)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def get_model_type(model: nn.Module) -> ModelType:
    """The model's ``model_type`` attribute, ``ModelType.encoder_or_decoder`` without one."""
    return getattr(unwrap_model(model), "model_type", ModelType.encoder_or_decoder)


def calc_params_l2_norm(model: nn.Module | list[nn.Module], bf16: bool) -> float:
    """The L2 norm of the whole model's parameters: tp-sharded ones counted once per shard, replicated ones once,
    summed over the model-parallel group (tp x pp)."""
    from meshpar.compat.apex.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    dims = get_parallel()
    total = torch.zeros((), dtype=torch.float64, device=dims.device)
    for module in listify_model(model):
        for param in module.parameters():
            if not param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                data = param.detach().to_local() if hasattr(param, "to_local") else param.detach()
                total += data.double().pow(2).sum()  # in float64 whatever the dtype (apex: bf16 -> fp32)
    if dims.tp * dims.pp > 1:
        for dim in ("tp", "pp"):
            if getattr(dims, dim) > 1:
                dist.all_reduce(total, group=getattr(dims, f"{dim}_mesh").get_group())
    return math.sqrt(total.item())


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The given scalar losses, each averaged over the data-parallel group (one all-reduce)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    dims = get_parallel()
    if dims.dp > 1:
        dist.all_reduce(averaged, group=dims.dp_mesh.get_group())
    return averaged / dims.dp


def get_autoresume() -> None:
    """apex never sets an autoresume handle: always ``None``."""
    return None


def print_params_min_max_norm(optimizer: Any, iteration: int) -> None:
    """Per parameter (of ``optimizer.optimizer``, apex's wrapped optimizer, or ``optimizer``): min, max and norm of
    this rank's values."""
    inner = getattr(optimizer, "optimizer", optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm"]
    index = 0
    for group in inner.param_groups:
        for param in group["params"]:
            index += 1
            data = param.detach()
            parallel = int(getattr(param, "tensor_model_parallel", False))
            lines.append(
                f"{iteration:7d}, {rank:4d}, {index:4d}, {parallel:2d}, {data.min().item():.6E}, "
                f"{data.max().item():.6E}, {torch.linalg.norm(data).item():.6E}"
            )
    print("\n".join(lines), flush=True)


def report_memory(name: str) -> None:
    """Allocated / reserved accelerator memory in MB, printed by dp rank 0 (zeros on CPU)."""
    mb = 1024.0 * 1024.0
    cuda = torch.cuda.is_available()
    stats = {
        key: (getattr(torch.cuda, f"{key}")() / mb if cuda else 0.0)
        for key in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
    }
    text = f"{name} memory (MB)" + "".join(f" | {key.replace('memory_', '')}: {v}" for key, v in stats.items())
    if get_parallel().dp_rank == 0:
        print(f"[Rank {dist.get_rank()}] {text}", flush=True)


def get_ltor_masks_and_position_ids(
    data: torch.Tensor, eod_token: int, reset_position_ids: bool, reset_attention_mask: bool, eod_mask_loss: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-to-right masks for GPT-style data ``[b, s]``: the attention mask (``True`` where attention is *not*
    allowed, ``[1 or b, 1, s, s]``), the loss mask (0 at ``eod_token`` with ``eod_mask_loss``) and position ids;
    with the reset flags, documents separated by ``eod_token`` neither see each other nor share positions."""
    batch, seq = data.shape
    rows = batch if reset_attention_mask else 1
    allowed = torch.tril(torch.ones((rows, seq, seq), device=data.device)).view(rows, 1, seq, seq)
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    positions = torch.arange(seq, dtype=torch.long, device=data.device).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        positions = positions.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(batch):
            start = 0
            for end in (data[b] == eod_token).nonzero().flatten().tolist():
                if reset_attention_mask:
                    allowed[b, 0, end + 1 :, : end + 1] = 0
                if reset_position_ids:
                    positions[b, end + 1 :] -= end + 1 - start
                    start = end + 1
    return allowed < 0.5, loss_mask, positions


class _Timer:
    """One named wall-clock timer; the accelerator is synchronised at start and stop so queued work is counted."""

    def __init__(self, name: str) -> None:
        self.name, self.total, self.running, self.since = name, 0.0, False, 0.0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._sync()
        self.since, self.running = time.perf_counter(), True

    def stop(self) -> None:
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} is not running")
        self._sync()
        self.total += time.perf_counter() - self.since
        self.running = False

    def reset(self) -> None:
        self.total, self.running = 0.0, False

    def elapsed(self, reset: bool = True) -> float:
        """Seconds counted so far (a running timer keeps running)."""
        running = self.running
        if running:
            self.stop()
        total = self.total
        if reset:
            self.reset()
        if running:
            self.start()
        return total


class _Timers:
    """apex's group of named timers: ``timers("forward").start()``, ``timers.log(["forward"])``."""

    def __init__(self) -> None:
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        return self.timers.setdefault(name, _Timer(name))

    def write(self, names: Sequence[str], writer: Any, iteration: int, normalizer: float = 1.0, reset: bool = False):
        """Each timer's seconds / ``normalizer`` to a TensorBoard-style ``writer.add_scalar``."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        for name in names:
            writer.add_scalar(f"{name}-time", self.timers[name].elapsed(reset=reset) / normalizer, iteration)

    def log(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True) -> None:
        """Print the timers in milliseconds / ``normalizer`` on the last rank (every process without a group)."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        line = "time (ms)" + "".join(
            f" | {n}: {self.timers[n].elapsed(reset=reset) * 1000.0 / normalizer:.2f}" for n in names
        )
        if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
            print(line, flush=True)


_timers: _Timers | None = None


def _set_timers() -> None:
    """Create apex's timers (once, as apex asserts)."""
    global _timers
    if _timers is not None:
        raise AssertionError("timers is already initialized.")
    _timers = _Timers()


def get_timers() -> _Timers:
    """apex's timers; apex itself never creates them, so this fails until ``_set_timers()`` ran, as in apex."""
    if _timers is None:
        raise AssertionError("timers is not initialized.")
    return _timers


__all__ = [
    "average_losses_across_data_parallel_group",
    "calc_params_l2_norm",
    "get_autoresume",
    "get_current_global_batch_size",
    "get_kth_microbatch",
    "get_ltor_masks_and_position_ids",
    "get_micro_batch_size",
    "get_model_type",
    "get_num_microbatches",
    "get_timers",
    "is_last_rank",
    "listify_model",
    "param_is_not_shared",
    "print_params_min_max_norm",
    "print_rank_0",
    "print_rank_last",
    "report_memory",
    "setup_microbatch_calculator",
    "unwrap_model",
    "update_num_microbatches",
]
