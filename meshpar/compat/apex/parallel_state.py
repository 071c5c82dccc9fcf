"""``apex.transformer.parallel_state``: apex's names, keywords and defaults over meshpar's one mesh.

Every getter is meshpar's (:mod:`meshpar.parallel_state`); what apex adds lives here, in the view: its
``initialize_model_parallel`` signature (trailing-underscore keywords, sizes clamped to the world size, the backend
keywords), the virtual pipeline rank (the chunk apex's interleaved schedule and ``build_model`` are working on, which
the stage predicates read) and the encoder-decoder split rank (``pipeline_model_parallel_split_rank_``) with its
stage predicates and relative-position-embedding groups, apex's rank and size overrides
(``set_tensor_model_parallel_rank`` and the like: what the getters report, for tools that act as one rank of a
layout, as apex's do; the mesh and its groups are not changed), and apex's NCCL network helpers. meshpar's native API
carries none of this state.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist

from meshpar.parallel_dims import get_parallel
from meshpar.parallel_state import *  # noqa: F403 - apex's module holds every getter
from meshpar.parallel_state import destroy_model_parallel as _destroy_mesh
from meshpar.parallel_state import get_data_parallel_rank, model_parallel_is_initialized
from meshpar.parallel_state import get_pipeline_model_parallel_rank as _pipeline_rank
from meshpar.parallel_state import get_pipeline_model_parallel_world_size as _pipeline_size
from meshpar.parallel_state import get_tensor_model_parallel_rank as _tensor_rank
from meshpar.parallel_state import get_tensor_model_parallel_world_size as _tensor_size
from meshpar.parallel_state import get_virtual_pipeline_model_parallel_world_size as _virtual_size
from meshpar.parallel_state import initialize_model_parallel as _initialize_mesh

logger = logging.getLogger(__name__)

# apex's encoder-decoder split rank: the first pipeline rank that runs the decoder (None: a one-stack model)
_split_rank: int | None = None
# the model chunk (virtual stage) this rank is working on, kept with the parallel context it was set in (a new
# context starts at chunk 0, as apex's initialize_model_parallel sets it)
_virtual: tuple[object, int | None] | None = None

_BACKENDS = (None, "nccl", "ucc", "gloo")

# apex's overrides of what the rank and size getters report (None: the mesh's own)
_overrides: dict[str, int | None] = {}


def _overridden(name: str, actual: object) -> object:
    value = _overrides.get(name)
    return actual() if value is None else value


def get_tensor_model_parallel_world_size() -> int:
    return _overridden("tp_size", _tensor_size)


def get_pipeline_model_parallel_world_size() -> int:
    return _overridden("pp_size", _pipeline_size)


def get_tensor_model_parallel_rank() -> int:
    return _overridden("tp_rank", _tensor_rank)


def get_pipeline_model_parallel_rank() -> int:
    return _overridden("pp_rank", _pipeline_rank)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _overridden("vpp_size", _virtual_size)


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """What :func:`get_tensor_model_parallel_world_size` reports from now on (``None``: the mesh's again)."""
    _overrides["tp_size"] = world_size


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _overrides["pp_size"] = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _overrides["tp_rank"] = rank


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _overrides["pp_rank"] = rank


def set_virtual_pipeline_model_parallel_world_size(size: int | None) -> None:
    _overrides["vpp_size"] = size


def set_nccl_socket_envs() -> None:
    """NCCL over sockets for the groups made next (``NCCL_SOCKET_IFNAME`` must name the interface)."""
    if os.getenv("NCCL_SOCKET_IFNAME") is None:
        raise RuntimeError("set_nccl_socket_envs: NCCL_SOCKET_IFNAME is not set")
    os.environ["NCCL_NET"] = "Socket"


def set_nccl_ib_envs() -> None:
    """NCCL over InfiniBand for the groups made next."""
    os.environ["NCCL_NET"] = "IB"


def init_nccl_net(group: dist.ProcessGroup) -> None:
    """Bring up a new NCCL group's network with one small all-reduce."""
    probe = torch.ones(1, device="cuda")
    dist.all_reduce(probe, group=group)
    torch.cuda.synchronize()


def new_nccl_socket_group(ranks: list[int]) -> dist.ProcessGroup:
    set_nccl_socket_envs()
    group = dist.new_group(ranks, backend="nccl")
    init_nccl_net(group)
    return group


def new_nccl_ib_group(ranks: list[int]) -> dist.ProcessGroup:
    set_nccl_ib_envs()
    group = dist.new_group(ranks, backend="nccl")
    init_nccl_net(group)
    return group


def initialize_model_parallel(
    tensor_model_parallel_size_: int = 1,
    pipeline_model_parallel_size_: int = 1,
    virtual_pipeline_model_parallel_size_: int | None = None,
    pipeline_model_parallel_split_rank_: int | None = None,
    *,
    default_backend: str | None = None,
    p2p_backend: str | None = None,
) -> None:
    """apex's entry point: tp and pp clamped to the world size as apex does, data parallelism takes the rest.
    meshpar builds every group with the default process group's backend; a different ``default_backend`` /
    ``p2p_backend`` is accepted with a warning naming it (apex's "ucc" needs a UCC build of torch)."""
    global _split_rank
    for name, backend in (("default_backend", default_backend), ("p2p_backend", p2p_backend)):
        if backend not in _BACKENDS:
            raise ValueError(f"{name}={backend!r}: apex takes None, 'nccl' or 'ucc'")
        current = dist.get_backend() if dist.is_initialized() else None
        if backend is not None and current is not None and backend != current:
            warnings.warn(
                f"initialize_model_parallel({name}={backend!r}): meshpar builds every group with the default "
                f"process group's backend ({current!r})",
                stacklevel=2,
            )
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp = min(tensor_model_parallel_size_, world), min(pipeline_model_parallel_size_, world)
    split = pipeline_model_parallel_split_rank_
    if split is not None and not 0 <= split < pp:
        raise ValueError(
            f"pipeline_model_parallel_split_rank_={split} must be a pipeline rank (0 .. {pp - 1}): the encoder runs "
            "on the ranks before it, the decoder from it on (0: a decoder-only model)"
        )
    _initialize_mesh(tp, pp, virtual_pipeline_model_parallel_size_)
    _split_rank = pipeline_model_parallel_split_rank_
    _build_groups()


def destroy_model_parallel() -> None:
    """Forget the groups, the virtual rank and the split rank. The microbatch calculator stays, as in apex: it
    belongs to the pipeline utilities, not to the parallel state (apex's tests set it once and initialise twice)."""
    global _split_rank, _virtual
    _split_rank = _virtual = None
    _overrides.clear()
    _drop_groups()
    _destroy_mesh()


def _drop_groups() -> None:
    global _groups
    _groups = None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The chunk this rank works on: 0 in a fresh parallel context with virtual stages, ``None`` without them."""
    if _virtual is not None and _virtual[0] is get_parallel():
        return _virtual[1]
    return 0 if get_virtual_pipeline_model_parallel_world_size() is not None else None


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """The chunk this rank works on next (apex's interleaved schedule and ``build_model`` set it per chunk)."""
    global _virtual
    vpp = get_virtual_pipeline_model_parallel_world_size() or 1
    if rank is not None and not 0 <= rank < vpp:
        raise ValueError(f"virtual pipeline rank {rank} is out of range for virtual_pipeline_size={vpp}")
    _virtual = (get_parallel(), rank)


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """The first pipeline rank, and (unless ``ignore_virtual``) working on its first chunk."""
    vpp = get_virtual_pipeline_model_parallel_world_size() or 1
    if not ignore_virtual and vpp > 1 and (get_virtual_pipeline_model_parallel_rank() or 0) != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """The last pipeline rank, and (unless ``ignore_virtual``) working on its last chunk."""
    vpp = get_virtual_pipeline_model_parallel_world_size() or 1
    if not ignore_virtual and vpp > 1 and (get_virtual_pipeline_model_parallel_rank() or 0) != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_split_rank() -> int | None:
    return _split_rank


def set_pipeline_model_parallel_split_rank(rank: int | None) -> None:
    global _split_rank
    _split_rank = rank


def is_pipeline_stage_before_split(rank: int | None = None) -> bool:
    """Whether pipeline rank ``rank`` (default: this rank's) runs the encoder of an encoder-decoder model."""
    if get_pipeline_model_parallel_world_size() == 1 or _split_rank is None:
        return True
    rank = get_pipeline_model_parallel_rank() if rank is None else rank
    return rank < _split_rank


def is_pipeline_stage_after_split(rank: int | None = None) -> bool:
    """Whether pipeline rank ``rank`` (default: this rank's) runs the decoder of an encoder-decoder model."""
    if get_pipeline_model_parallel_world_size() == 1 or _split_rank is None:
        return True
    rank = get_pipeline_model_parallel_rank() if rank is None else rank
    return rank >= _split_rank


def is_pipeline_stage_at_split() -> bool:
    """The last encoder stage: the next pipeline rank runs the decoder."""
    rank = get_pipeline_model_parallel_rank()
    return is_pipeline_stage_before_split(rank) and is_pipeline_stage_after_split(rank + 1)


def is_rank_in_encoder_relative_position_embedding_group() -> bool:
    """This rank is in the encoder's relative-position-embedding group as initialised (every rank at pp=1; the
    ranks before the split rank with one; else the first stage)."""
    return dist.get_rank() in _group_of("encoder_relative_position_embedding")[1]


def is_rank_in_decoder_relative_position_embedding_group() -> bool:
    """This rank is in the decoder's relative-position-embedding group as initialised (every rank at pp=1; the
    split rank and after with one; else the first stage)."""
    return dist.get_rank() in _group_of("decoder_relative_position_embedding")[1]


class ExperimentalWarning(Warning):
    """apex's warning category for experimental code paths."""


# apex's extra groups, built by initialize_model_parallel (every rank takes part in every new_group, in one order),
# kept with the parallel context they were built for: kind -> (this rank's group, its global ranks)
_groups: tuple[object, dict[str, tuple[dist.ProcessGroup, list[int]]]] | None = None


def _members(kind: str) -> list[list[int]]:
    """Every group of ``kind``, as lists of global ranks (apex's rules; an empty one is not created)."""
    dims = get_parallel()
    grid = dims.mesh.mesh  # [dp, pp, cp, tp] global ranks (cp is 1 under apex)
    split = _split_rank
    if kind == "model":  # tp x pp of one data-parallel replica
        return [grid[d].flatten().tolist() for d in range(dims.dp)]
    if kind == "amax":  # tp x dp of one pipeline stage (apex's fp8 amax reduction)
        return [grid[:, p, :].flatten().tolist() for p in range(dims.pp)]
    groups = []
    for ranks in dims.group_ranks("pp"):
        if len(ranks) == 1:  # no pipeline: every group is the one rank
            groups.append(list(ranks))
            continue
        if kind == "embedding":
            picked = [ranks[0], ranks[-1]] + ([ranks[split]] if split is not None else [])
        elif kind == "position_embedding":
            picked = [ranks[0]] + ([ranks[split]] if split is not None else [])
        elif kind == "encoder_relative_position_embedding":
            picked = ranks[:split] if split is not None else [ranks[0]]
        else:  # decoder_relative_position_embedding
            picked = ranks[split:] if split is not None else [ranks[0]]
        if picked:
            groups.append(sorted(set(picked)))
    return groups


_KINDS = (
    "model",
    "amax",
    "embedding",
    "position_embedding",
    "encoder_relative_position_embedding",
    "decoder_relative_position_embedding",
)


def _build_groups() -> None:
    global _groups
    me, mine = dist.get_rank(), {}
    for kind in _KINDS:
        for ranks in _members(kind):
            group = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = (group, ranks)
    _groups = (get_parallel(), mine)


def _group_of(kind: str) -> tuple[dist.ProcessGroup | None, list[int]]:
    if _groups is None or _groups[0] is not get_parallel():
        raise RuntimeError(
            f"apex's {kind.replace('_', ' ')} group exists after apex's initialize_model_parallel "
            "(meshpar.compat.apex.parallel_state); this parallel state was set up another way"
        )
    return _groups[1].get(kind, (None, []))


def get_model_parallel_group() -> dist.ProcessGroup:
    return _group_of("model")[0]


def get_amax_reduction_group() -> dist.ProcessGroup:
    return _group_of("amax")[0]


def get_embedding_group() -> dist.ProcessGroup | None:
    return _group_of("embedding")[0]


def get_position_embedding_group() -> dist.ProcessGroup | None:
    return _group_of("position_embedding")[0]


def get_encoder_relative_position_embedding_group() -> dist.ProcessGroup | None:
    return _group_of("encoder_relative_position_embedding")[0]


def get_decoder_relative_position_embedding_group() -> dist.ProcessGroup | None:
    return _group_of("decoder_relative_position_embedding")[0]


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """This rank holds an embedding copy: the first or last pipeline stage (the split rank's too); unless
    ``ignore_virtual``, only while working on the first / last chunk there."""
    rank = dist.get_rank()
    _, ranks = _group_of("embedding")
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    pipeline = dist.get_process_group_ranks(get_parallel().pp_mesh.get_group())
    if rank == pipeline[0]:
        return is_pipeline_first_stage()
    if rank == pipeline[-1]:
        return is_pipeline_last_stage()
    return True


def is_rank_in_position_embedding_group() -> bool:
    return dist.get_rank() in _group_of("position_embedding")[1]


def is_unitialized() -> bool:  # apex's spelling
    """Whether no parallel state is set up (apex's name keeps its typo)."""
    return not model_parallel_is_initialized()


def get_rank_info() -> tuple[int, int, int | None, int]:
    """``(tp rank, pp rank, virtual pp rank, dp rank)``; zeros before initialisation."""
    if not model_parallel_is_initialized():
        return (0, 0, 0, 0)
    return (
        get_tensor_model_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_virtual_pipeline_model_parallel_rank(),
        get_data_parallel_rank(),
    )


def get_data_parallel_src_rank() -> int:
    """Global rank of dp rank 0 in this rank's data-parallel group."""
    return dist.get_process_group_ranks(get_parallel().dp_mesh.get_group())[0]


def _pipeline_ranks() -> list[int]:
    return dist.get_process_group_ranks(get_parallel().pp_mesh.get_group())


def get_pipeline_model_parallel_first_rank() -> int:
    return _pipeline_ranks()[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _pipeline_ranks()[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _pipeline_ranks()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _pipeline_ranks()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def new_process_group(ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    """A process group of ``ranks`` (a collective call on every rank, as ``torch.distributed.new_group``)."""
    return dist.new_group(ranks, backend=backend)
