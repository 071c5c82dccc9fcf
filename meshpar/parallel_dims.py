"""The one parallel context of meshpar: a ``DeviceMesh`` with dims ``("dp", "pp", "cp", "tp")``.

Rank layout follows Megatron: tp varies fastest, then pp, then dp. With world size 8 and
``tp=2, pp=2, dp=2`` the tp groups are ``[0, 1], [2, 3], ...``, the pp groups ``[0, 2], [1, 3], ...`` and the
dp groups ``[0, 4], [1, 5], ...``. This is exactly the row-major order of a mesh of shape ``(dp, pp, tp)``. Context
parallelism (``cp``, :mod:`meshpar.context_parallel`) is a dim of its own between pp and tp (size 1 unless asked
for): the cp ranks of one (dp, pp, tp) position split each sequence, and dense grads are reduced over dp and cp
together (:attr:`ParallelDims.grad_mesh`).

Expert parallelism (``ep``) is carved out of dp x cp, as in Megatron-Core and torchtitan: the dp x cp ranks of each
(pp, tp) position (cp varying fastest) are split into ``("edp", "ep")`` with ep varying fastest, so with dp=4 and
ep=2 the dp ranks ``[0, 1]`` and ``[2, 3]`` of each (pp, tp) position form the ep groups and ``[0, 2]``, ``[1, 3]``
the expert-data-parallel groups, and with cp=2, dp=1, ep=2 the two cp ranks form the ep group. Experts are sharded
over ``("ep", "tp")`` (:attr:`ParallelDims.expert_mesh`), everything else keeps its tp layout; the batch is still split
over all of dp (ep does not split it again), and an expert's grads are reduced over edp only (their sum divided by
dp, as the dense grads' over dp x cp).

::

    dp=4, pp=1, tp=2, ep=2 (8 ranks)      dense weights: tp shards, replicated over dp
        dp:   0     1     2     3         experts:       over (ep, tp): E / (ep * tp) whole experts per rank
      tp0 [  0  |  2 ] [  4  |  6 ]       ep groups  (tp0): [0, 2], [4, 6]   edp groups (tp0): [0, 4], [2, 6]
      tp1 [  1  |  3 ] [  5  |  7 ]       ep groups  (tp1): [1, 3], [5, 7]   edp groups (tp1): [1, 5], [3, 7]
          '--ep--'     '--ep--'
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh, flatten_mesh_dims, init_device_mesh, unflatten_mesh_dim
from meshpar.failure import require_process_groups

logger = logging.getLogger(__name__)

MESH_DIM_NAMES = ("dp", "pp", "cp", "tp")
EXPERT_DIM_NAMES = ("edp", "ep")  # the dp dim split for expert parallelism, ep fastest


def check_virtual_pipeline_size(pp: int, virtual_pipeline_size: int | None) -> None:
    """The one check that interleaving (several model chunks per rank) has a pipeline to interleave."""
    if virtual_pipeline_size is not None and virtual_pipeline_size > 1 and pp == 1:
        raise ValueError(f"virtual_pipeline_size={virtual_pipeline_size} needs pipeline parallelism (pp > 1), got pp=1")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class _BuiltMesh:
    world: dist.ProcessGroup | None  # the default group the mesh's groups belong to
    mesh: DeviceMesh
    expert_mesh: DeviceMesh | None  # (edp, ep, pp, cp, tp) with dp split in two, or (edp, ep, pp, tp) with dp x cp
    # split in two; None when ep == 1
    dp_cp_mesh: DeviceMesh | None  # dp and cp flattened into one dim; None when cp == 1
    extra_groups: dict[str, dist.ProcessGroup | None]  # see ParallelDims.pipeline_ends_group


# One mesh per layout for the life of the process's default group. Every mesh owns gloo sockets and threads (NCCL
# communicators) that nothing frees, so re-initialising meshpar again and again (a test suite, a sweep, apex's
# destroy_model_parallel / initialize_model_parallel) would pile them up. Freeing them is not safe: torch treats
# equal meshes as one (DTensor's sharding cache hands back specs holding an equal mesh built earlier), so a freed
# mesh's groups would still be reached. Reusing the mesh of an equal layout is what torch assumes anyway.
_BUILT_MESHES: dict[tuple[str, int, int, int, int, int], _BuiltMesh] = {}


@dataclass
class ParallelDims:
    """Sizes of the three parallel dimensions (and of ep, carved out of dp) and, once built, the mesh over them.

    Validation happens in ``__post_init__`` and uses only local information, so a wrong layout raises on every
    rank before any process group or collective is created.
    """

    dp: int
    pp: int
    tp: int
    world_size: int
    virtual_pipeline_size: int | None = None
    seed: int = 1234
    ep: int = 1  # expert parallelism: a divisor of dp (see the module docstring)
    cp: int = 1  # context parallelism: each sequence split over cp ranks (meshpar.context_parallel)
    mesh: DeviceMesh | None = field(default=None, repr=False)
    _expert_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _dp_cp_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    # process groups that are not mesh dims, created once per mesh (see pipeline_ends_group)
    _extra_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive("world_size", self.world_size)
        _check_positive("tp", self.tp)
        _check_positive("pp", self.pp)
        _check_positive("cp", self.cp)
        names, sizes = ("tp*pp", [self.tp, self.pp]) if self.cp == 1 else ("tp*cp*pp", [self.tp, self.cp, self.pp])
        model = self.tp * self.pp * self.cp
        if self.dp == -1:
            if self.world_size % model != 0:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by {names} = {'*'.join(map(str, sizes))} = "
                    f"{model}; choose sizes whose product divides the world size"
                )
            self.dp = self.world_size // model
        _check_positive("dp", self.dp)
        if self.dp * model != self.world_size:
            shown = f"dp*pp*tp = {self.dp}*{self.pp}*{self.tp}" if self.cp == 1 else (
                f"dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp}"
            )  # fmt: skip
            raise ValueError(
                f"{shown} = {self.dp * model} does not equal the world size {self.world_size}; pass dp=-1 to use "
                "the rest of the world for data parallelism"
            )
        _check_positive("ep", self.ep)
        replicas = self.dp * self.cp  # the ranks of one (pp, tp) position that hold every dense weight
        if replicas % self.ep:
            what = "data parallel size" if self.cp == 1 else "data x context parallel size"
            raise ValueError(
                f"expert parallel size {self.ep} does not divide the {what} {replicas} (ep is carved out of dp x cp: "
                f"the experts of each ep group are spread over ep of those ranks); use ep in "
                f"{{{', '.join(str(d) for d in range(1, replicas + 1) if replicas % d == 0)}}}"
            )
        if self.virtual_pipeline_size is not None:
            _check_positive("virtual_pipeline_size", self.virtual_pipeline_size)
            check_virtual_pipeline_size(self.pp, self.virtual_pipeline_size)

    # -- mesh ---------------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the ``(dp, pp, cp, tp)`` mesh, or take the one built earlier in this process for the same layout (a
        collective call on every rank the first time). See ``_BUILT_MESHES`` for why meshes are reused, not freed."""
        key = (device_type, self.dp, self.pp, self.cp, self.tp, self.ep)
        built = _BUILT_MESHES.get(key)
        if built is None or built.world is not dist.GroupMember.WORLD:  # none yet, or torch.distributed restarted
            shape = (self.dp, self.pp, self.cp, self.tp)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
            experts = self._carve_experts(mesh) if self.ep > 1 else None
            # the dense weights' grads are summed over cp (each cp rank saw a part of every sequence) and dp
            dp_cp = flatten_mesh_dims(mesh, ("dp", "cp"), "dp_cp") if self.cp > 1 else None
            built = _BuiltMesh(dist.GroupMember.WORLD, mesh, experts, dp_cp, {})
            _BUILT_MESHES[key] = built
        self.mesh, self._expert_mesh, self._extra_groups = built.mesh, built.expert_mesh, built.extra_groups
        self._dp_cp_mesh = built.dp_cp_mesh
        return self.mesh

    def _carve_experts(self, mesh: DeviceMesh) -> DeviceMesh:
        """The expert mesh: dp split into ``(edp, ep)`` (a collective call on every rank); under cp the dp x cp ranks
        of each (pp, tp) position, cp fastest, split so (a mesh of its own over the same ranks)."""
        if self.cp == 1:
            return unflatten_mesh_dim(mesh, "dp", (self.dp // self.ep, self.ep), EXPERT_DIM_NAMES)
        ranks = mesh.mesh.permute(0, 2, 1, 3).reshape(self.dp * self.cp // self.ep, self.ep, self.pp, self.tp)
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*EXPERT_DIM_NAMES, "pp", "tp"))

    def _require_mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("the mesh is not built yet; call meshpar.init_parallel() first")
        return self.mesh

    @property
    def device_type(self) -> str:
        return self._require_mesh().device_type

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self._require_mesh()["tp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self._require_mesh()["pp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self._require_mesh()["dp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self._require_mesh()["cp"]

    @property
    def cp_rank(self) -> int:
        return self._local_rank("cp")

    @property
    def grad_mesh(self) -> DeviceMesh:
        """The ranks over which a dense weight's grads are reduced: dp, and cp with it (each cp rank computed the
        grads of its part of every sequence); their sum is divided by dp alone."""
        self._require_mesh()
        return self._dp_cp_mesh if self._dp_cp_mesh is not None else self.dp_mesh

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The 2-D ``("ep", "tp")`` mesh that expert weights are sharded over (``[Shard(0), Shard(0)]``: split into ep
        blocks of experts, each block over tp); the tp mesh itself when ep == 1."""
        self._require_mesh()
        return self._expert_mesh["ep", "tp"] if self._expert_mesh is not None else self.tp_mesh

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The ep group of this rank (1-D), ``None`` when ep == 1."""
        self._require_mesh()
        return self._expert_mesh["ep"] if self._expert_mesh is not None else None

    @property
    def edp_mesh(self) -> DeviceMesh:
        """The expert-data-parallel group: the dp ranks holding the same experts, over which expert grads are
        reduced (all of dp when ep == 1)."""
        self._require_mesh()
        return self._expert_mesh["edp"] if self._expert_mesh is not None else self.dp_mesh

    @property
    def expert_dp_mesh(self) -> DeviceMesh | None:
        """:attr:`edp_mesh` under expert parallelism, ``None`` without it (what :class:`DataParallelGrads` takes)."""
        return self.edp_mesh if self.ep > 1 else None

    @property
    def ep_rank(self) -> int:
        return self._expert_mesh.get_local_rank("ep") if self._expert_mesh is not None else 0

    def _local_rank(self, dim: str) -> int:
        return self._require_mesh().get_local_rank(dim)

    @property
    def tp_rank(self) -> int:
        return self._local_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self._local_rank("pp")

    @property
    def dp_rank(self) -> int:
        return self._local_rank("dp")

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups of global ranks along ``dim``, e.g. ``[[0, 1], [2, 3]]`` for tp=2 on 4 ranks. The expert dims
        ``"ep"`` and ``"edp"`` are those of the expert mesh; without expert parallelism every ep group is one rank
        and the edp groups are the dp groups."""
        if dim not in MESH_DIM_NAMES + EXPERT_DIM_NAMES:
            raise ValueError(f"unknown mesh dim {dim!r}; expected one of {MESH_DIM_NAMES + EXPERT_DIM_NAMES}")
        mesh = self._require_mesh()
        if dim in EXPERT_DIM_NAMES:
            if self._expert_mesh is None:
                return self.group_ranks("dp") if dim == "edp" else [[r] for r in mesh.mesh.flatten().tolist()]
            mesh = self._expert_mesh
        ranks = mesh.mesh
        axis = mesh.mesh_dim_names.index(dim)
        moved = ranks.movedim(axis, -1)
        return moved.reshape(-1, ranks.shape[axis]).tolist()

    def pipeline_ends_group(self) -> dist.ProcessGroup | None:
        """Megatron's embedding group: the first and last pipeline rank of each (dp, tp) position, which hold the
        two copies of a tied embedding / LM head. Created on first use (a collective call on every rank) and reused
        for the life of the mesh; ``None`` on ranks in neither end, and when pp == 1."""
        if "pipeline_ends" not in self._extra_groups:
            mine = None
            if self.pp > 1:
                for ranks in self.group_ranks("pp"):
                    group = dist.new_group([ranks[0], ranks[-1]])  # every rank takes part in every new_group
                    if dist.get_rank() in (ranks[0], ranks[-1]):
                        mine = group
            self._extra_groups["pipeline_ends"] = mine
        return self._extra_groups["pipeline_ends"]


_PARALLEL: ParallelDims | None = None


def _gpu_shortfall() -> str | None:
    """Why this host cannot give each local rank its own GPU (``None`` when it can)."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    gpus, local_ranks = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return f"{local_ranks} local ranks but {gpus} GPU(s) on this host" if gpus < local_ranks else None


def _default_device_type() -> str:
    """CUDA when this host has a GPU for every local rank; else the CPU (with a warning if it has some GPUs), so
    ``torchrun --nproc-per-node 4`` on a one-GPU workstation runs on gloo instead of failing in ``set_device``. An
    existing process group decides by its backend (a gloo group, as the test harness starts, means the CPU)."""
    if dist.is_initialized():
        return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    shortfall = _gpu_shortfall()
    if shortfall is None:
        return "cuda"
    if torch.cuda.is_available():
        logger.warning("%s: running on the CPU with gloo (pass device_type='cuda' to insist)", shortfall)
    return "cpu"


def _check_devices(device_type: str) -> None:
    """A CUDA layout needs one GPU per local rank; say so before ``set_device`` fails with an opaque ordinal error."""
    shortfall = _gpu_shortfall() if device_type == "cuda" else None
    if shortfall is not None:
        raise ValueError(
            f"device_type='cuda' needs one GPU per local rank: {shortfall}; start fewer processes per node or use "
            "device_type='cpu' (gloo)"
        )


def _restart_store(timeout: datetime.timedelta | None) -> dict:
    """Under torchrun the workers' rendezvous store is the agent's, and it outlives a restart: a restarted job would
    read the dead attempt's gloo addresses and fail to connect (torch 2.13, ``Gloo connectFullMesh failed``). Each
    attempt gets its own key space (``TORCHELASTIC_RESTART_COUNT``), so ``torchrun --max-restarts`` works."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    return {
        "store": dist.PrefixStore(f"meshpar/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def _init_process_group(backend: str, device_type: str, timeout: datetime.timedelta | None) -> None:
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, **kwargs, **_restart_store(timeout))
    else:
        # A plain ``python script.py``: a one-process group so that the same code runs without torchrun.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    # the group meshpar made is torn down before the interpreter exits: left to C++ static destruction, a backend's
    # worker threads can be destroyed while still joinable, and the process then aborts after the script succeeded
    # ("terminate called without an active exception", seen once in a CI run of the Quick start)
    atexit.register(_destroy_own_process_group)


def _destroy_own_process_group() -> None:
    """At exit, after the script ran: groups a failure aborted are left alone, and an error here is only logged
    (the script's own outcome stands)."""
    from meshpar.failure import process_groups_aborted

    if not dist.is_initialized() or process_groups_aborted():
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # exit-time clean-up must not change how the script ended
        logger.debug("destroying the process group at exit failed: %s", error)


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    dp: int = -1,
    *,
    virtual_pipeline_size: int | None = None,
    device_type: str | None = None,
    backend: str | None = None,
    seed: int = 1234,
    timeout: datetime.timedelta | None = None,
    ep: int = 1,
    cp: int = 1,
) -> ParallelDims:
    """Initialise ``torch.distributed`` if needed and build meshpar's ``(dp, pp, cp, tp)`` mesh.

    ``dp=-1`` takes the rest of the world; ``ep`` (expert parallelism) is carved out of dp and must divide it. The
    backend defaults to ``nccl`` on CUDA and ``gloo`` on CPU. All sizes are checked against the world size before
    any process group is created, so a wrong layout raises the same ``ValueError`` on every rank instead of hanging
    in a collective. ``seed`` seeds the default generator identically on every rank (so every rank builds the same
    dense weights) and the tensor-parallel RNG tracker per tp rank.
    """
    global _PARALLEL
    require_process_groups("init_parallel")
    if _PARALLEL is not None:
        raise RuntimeError("meshpar is already initialised; call meshpar.destroy_parallel() first")
    device_type = device_type or _default_device_type()
    if not dist.is_initialized():
        _check_devices(device_type)
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims(
        dp=dp,
        pp=pp,
        tp=tp,
        world_size=world_size,
        virtual_pipeline_size=virtual_pipeline_size,
        seed=seed,
        ep=ep,
        cp=cp,
    )
    if not dist.is_initialized():
        _init_process_group(backend, device_type, timeout)
    dims.build_mesh(device_type)
    _PARALLEL = dims
    from meshpar.random import model_parallel_manual_seed

    model_parallel_manual_seed(seed, dims)
    logger.info("meshpar initialised: %s", dims)
    return dims


def get_parallel() -> ParallelDims:
    """The current parallel context; raises if :func:`init_parallel` was not called."""
    if _PARALLEL is None:
        raise RuntimeError("meshpar is not initialised; call meshpar.init_parallel(tp=..., pp=..., dp=...) first")
    require_process_groups("the parallel context")
    return _PARALLEL


def _set_parallel(dims: ParallelDims | None) -> None:
    """Install an already-built context (used by :mod:`meshpar.testing` to reuse process groups)."""
    global _PARALLEL
    _PARALLEL = dims


def is_initialized() -> bool:
    return _PARALLEL is not None


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Forget the mesh context (and optionally tear down ``torch.distributed``) so that it can be re-initialised."""
    global _PARALLEL
    _PARALLEL = None
    from meshpar.random import get_rng_tracker

    get_rng_tracker().reset()
    if destroy_process_group and dist.is_initialized():
        _BUILT_MESHES.clear()
        dist.destroy_process_group()
