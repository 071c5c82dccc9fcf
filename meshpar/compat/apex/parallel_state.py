"""``apex.transformer.parallel_state``: apex's names, keywords and defaults over meshpar's one mesh.

Every getter is meshpar's (:mod:`meshpar.parallel_state`); what apex adds lives here, in the view: its
``initialize_model_parallel`` signature (trailing-underscore keywords, sizes clamped to the world size, the backend
keywords), the virtual pipeline rank (the chunk apex's interleaved schedule and ``build_model`` are working on, which
the stage predicates read) and the encoder-decoder split rank (``pipeline_model_parallel_split_rank_``) with its
stage predicates and relative-position-embedding groups. meshpar's native API carries none of this state.
"""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist

from meshpar.parallel_dims import get_parallel
from meshpar.parallel_state import *  # noqa: F403 - apex's module holds every getter
from meshpar.parallel_state import destroy_model_parallel as _destroy_mesh
from meshpar.parallel_state import (
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_world_size,
)
from meshpar.parallel_state import initialize_model_parallel as _initialize_mesh
from meshpar.parallel_state import is_pipeline_first_stage as _is_first_pipeline_rank
from meshpar.parallel_state import is_pipeline_last_stage as _is_last_pipeline_rank

logger = logging.getLogger(__name__)

# apex's encoder-decoder split rank: the first pipeline rank that runs the decoder (None: a one-stack model)
_split_rank: int | None = None
# the model chunk (virtual stage) this rank is working on, kept with the parallel context it was set in (a new
# context starts at chunk 0, as apex's initialize_model_parallel sets it)
_virtual: tuple[object, int | None] | None = None

_BACKENDS = (None, "nccl", "ucc", "gloo")


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
    if pipeline_model_parallel_split_rank_ is not None and not 0 < pipeline_model_parallel_split_rank_ < pp:
        raise ValueError(
            f"pipeline_model_parallel_split_rank_={pipeline_model_parallel_split_rank_} must be a pipeline rank "
            f"after the first one (1 .. {pp - 1}): the encoder runs on the ranks before it, the decoder from it on"
        )
    _initialize_mesh(tp, pp, virtual_pipeline_model_parallel_size_)
    _split_rank = pipeline_model_parallel_split_rank_


def destroy_model_parallel() -> None:
    global _split_rank, _virtual
    from meshpar.compat.apex.pipeline_parallel.utils import _drop_microbatch_calculator

    _split_rank = _virtual = None
    _drop_microbatch_calculator()
    _destroy_mesh()


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
    return _is_first_pipeline_rank()


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """The last pipeline rank, and (unless ``ignore_virtual``) working on its last chunk."""
    vpp = get_virtual_pipeline_model_parallel_world_size() or 1
    if not ignore_virtual and vpp > 1 and (get_virtual_pipeline_model_parallel_rank() or 0) != vpp - 1:
        return False
    return _is_last_pipeline_rank()


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
    """apex's groups: every stage at pp=1; the encoder stages with a split rank; else the first stage."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    rank = get_pipeline_model_parallel_rank()
    return rank < _split_rank if _split_rank is not None else rank == 0


def is_rank_in_decoder_relative_position_embedding_group() -> bool:
    """apex's groups: every stage at pp=1; the decoder stages with a split rank; else the first stage."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    rank = get_pipeline_model_parallel_rank()
    return rank >= _split_rank if _split_rank is not None else rank == 0
