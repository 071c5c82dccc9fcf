"""Every private or version-sensitive torch import of meshpar lives here.

A torch upgrade that moves one of these names should only need a change in this file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT as PP_BACKWARD_INPUT,
)
from torch.distributed.pipelining.schedules import (
    BACKWARD_WEIGHT as PP_BACKWARD_WEIGHT,
)
from torch.distributed.pipelining.schedules import (
    FORWARD as PP_FORWARD,
)
from torch.distributed.pipelining.schedules import (
    FULL_BACKWARD as PP_FULL_BACKWARD,
)
from torch.distributed.pipelining.schedules import (
    RECV_B as PP_RECV_B,
)
from torch.distributed.pipelining.schedules import (
    REDUCE_GRAD as PP_REDUCE_GRAD,
)
from torch.distributed.pipelining.schedules import (
    SEND_B as PP_SEND_B,
)
from torch.distributed.pipelining.schedules import (
    _Action as PPAction,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as PipelineScheduleRuntime,
)
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp shard of a tp-sharded dim
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

# what ``nn.Module.load_state_dict`` returns (missing_keys, unexpected_keys), for loaders that merge several results
IncompatibleKeys = torch.nn.modules.module._IncompatibleKeys

# an assertion on a tensor that raises without a host sync on accelerators (immediately on the CPU)
assert_async = torch._assert_async


def make_wrapper_subclass(cls: type, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An instance of the tensor subclass ``cls`` with this metadata and no storage of its own (torch's wrapper-
    subclass constructor, for ``__torch_dispatch__`` subclasses)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


# torch >= 2.13 renamed the dim-aware functional collectives; same signatures.
all_gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
# and the flat-tensor c10d ones (the old names warn there); same signatures, the same c10d ops underneath
dist_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
dist_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def all_reduce_start(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Start a sum all-reduce and return its (not yet valid) output; pass it to :func:`all_reduce_wait` before use.

    ``funcol.all_reduce`` inserts its wait right after the collective when traced, so the compiler cannot overlap
    it with later work; the raw functional op leaves the wait where the caller puts it."""
    return torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", mesh.get_group().group_name)


def all_reduce_wait(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(x)


def unflatten_mesh_dim(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with its dim ``dim`` split into ``names`` of ``sizes`` (outer first), a new process group per new
    dim (a collective call on every rank). Private in torch 2.13 (``DeviceMesh._unflatten``), as torchtitan uses it
    to carve its expert dims out of dp."""
    return mesh._unflatten(mesh.mesh_dim_names.index(dim), sizes, names)


def flatten_mesh_dims(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """One 1-D mesh over the ranks of ``dims`` (they need not be adjacent), a new process group (a collective call
    on every rank). Private in torch 2.13 (``DeviceMesh._flatten``)."""
    return mesh[dims]._flatten(name)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without an autograd node (``DTensor._local_tensor``, private); a plain tensor as is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of this rank's shard of ``t``: the box DCP saves (``compute_local_shape_and_
    global_offset``, private; uneven shards included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offsets)


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local`` (no checks, no autograd): the
    cheap way to hand a local grad back for a DTensor parameter."""
    try:
        return DTensor(local, like._spec, requires_grad=False)
    except (TypeError, AttributeError):  # constructor changed: the public (slower) route
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())  # fmt: skip


def custom_op_body(op: object) -> object | None:
    """The Python function behind a ``torch.library`` custom op (for a ``triton_op``, the wrapper that launches its
    kernels without HOP dispatch), or ``None`` if this torch keeps it elsewhere."""
    return getattr(op, "_init_fn", None)


def plain_eager_context(tensors: tuple) -> bool:
    """Whether ``tensors`` are plain tensors outside every tracer: not compiling, no dispatch mode (fake tensors,
    make_fx, CommDebugMode, op counters), no functorch transform, no tensor subclass."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(type(t) is torch.Tensor for t in tensors if isinstance(t, torch.Tensor))


def run_backward_unchecked(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad: torch.Tensor | Sequence[torch.Tensor],
    inputs: tuple[torch.Tensor, ...] = (),
    keep_graph: bool = False,
) -> None:
    """Backward from ``output`` (one tensor or several, with as many grads) without the shape check, for outputs
    whose data was freed after sending (Megatron's ``custom_backward``); ``inputs``: accumulate only these tensors'
    grads."""
    outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
    grads = (grad,) if isinstance(grad, torch.Tensor) or grad is None else tuple(grad)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=outputs,
        grad_tensors=grads,
        keep_graph=keep_graph,
        create_graph=False,
        inputs=inputs,
        allow_unreachable=True,
        accumulate_grad=True,
    )


def grad_needed(ctx: Any, edge: int) -> bool:
    """Inside a custom autograd function's backward: whether the running backward pass uses the grad of the
    ``edge``-th *tensor* input of forward (arguments that are not tensors, ``None`` included, have no edge).
    ``ctx.needs_input_grad`` says whether an input requires grad at all; this also knows when a pass runs towards
    some inputs only (a zero-bubble schedule's separate input-grad and weight-grad passes)."""
    node = ctx.next_functions[edge][0]
    if node is None:
        return False
    if torch.compiler.is_compiling():  # traced ahead of any backward pass: keep every grad
        return True
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf under torch.autograd.grad (torch's pipelining runtime) cannot be asked: compute it
        return True


# torch's fused attention kernels with an explicit log-sum-exp (meshpar._block_attention: the ring's steps); the
# memory-efficient kernel's backward takes its dropout seed and offset, unused without dropout
flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_attention_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
efficient_attention = torch.ops.aten._scaled_dot_product_efficient_attention
efficient_attention_backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward

# torch's grouped GEMM (CUTLASS on Hopper), where this torch has it (meshpar.ops.grouped_mm)
vendor_grouped_mm = getattr(torch, "_grouped_mm", None)


__all__ = [
    "PP_BACKWARD_INPUT",
    "PP_BACKWARD_WEIGHT",
    "PP_FORWARD",
    "PP_FULL_BACKWARD",
    "PP_RECV_B",
    "PP_REDUCE_GRAD",
    "PP_SEND_B",
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "IncompatibleKeys",
    "PPAction",
    "ParallelStyle",
    "Partial",
    "PipelineScheduleRuntime",
    "PipelineStage",
    "Placement",
    "Replicate",
    "Shard",
    "_StridedShard",
    "all_gather_single",
    "custom_op_body",
    "distribute_tensor",
    "efficient_attention",
    "efficient_attention_backward",
    "flash_attention_cpu",
    "flash_attention_cpu_backward",
    "grad_needed",
    "dtensor_like",
    "funcol",
    "init_device_mesh",
    "plain_eager_context",
    "reduce_scatter_single",
    "run_backward_unchecked",
    "TorchDispatchMode",
    "add_dcp_aliases",
    "assert_async",
    "make_wrapper_subclass",
    "tree_flatten",
    "tree_map_only",
    "vendor_grouped_mm",
]


def default_store() -> dist.Store | None:
    """The rendezvous store of the default process group (``None`` when it has none)."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


def is_registered_process_group(group: object) -> bool:
    """Whether ``group`` is a process group torch.distributed made and still holds (so a ``DeviceMesh`` can be built
    over it), not a stand-in object or a bare ``ProcessGroup(rank, size)``."""
    from torch.distributed.distributed_c10d import _world

    return isinstance(group, dist.ProcessGroup) and group in _world.pg_group_ranks


def abort_all_process_groups() -> None:
    """Abort every process group of this process and forget them (``dist.is_initialized()`` is false after).

    NCCL's abort tears its communicators down, so peers blocked with this rank fail at once. Gloo's abort (torch
    2.13) only stops local work and keeps its connections open; :mod:`meshpar.failure` closes those itself."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


def add_dcp_aliases(checkpoint_dir: str, aliases: dict[str, str]) -> list[str]:
    """Make each ``alias`` key of a finished DCP checkpoint read the stored data of its ``source`` key (alias ->
    source, full DCP keys such as ``model.lm_head.weight``): tied weights are written once, yet a plain ``dcp.load``
    of a model's full ``state_dict()`` finds both names. Rewrites DCP's ``.metadata`` (its pickled format and file
    name are DCP internals, hence here); returns the aliases added."""
    import os
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    added = []
    for alias, source in aliases.items():
        if alias in metadata.state_dict_metadata or source not in metadata.state_dict_metadata:
            continue
        metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[source]
        if isinstance(metadata.planner_data, dict) and source in metadata.planner_data:
            head = metadata.planner_data[source][0]
            metadata.planner_data[alias] = (head, alias.removeprefix(f"{head}."))
        for index, info in list((metadata.storage_data or {}).items()):
            if index.fqn == source:
                metadata.storage_data[MetadataIndex(alias, index.offset, index.index)] = info
        added.append(alias)
    if added:
        path = os.path.join(checkpoint_dir, ".metadata")
        with open(path + ".tmp", "wb") as handle:
            pickle.dump(metadata, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(path + ".tmp", path)
    return added
