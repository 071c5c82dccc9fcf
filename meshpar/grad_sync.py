"""Data-parallel gradient averaging that overlaps backward (Megatron's ``overlap_grad_reduce``, torch DDP's buckets).

:func:`meshpar.data_parallel.allreduce_gradients` starts its all-reduce after backward has finished, so the whole
dp reduction sits on the critical path. :class:`OverlappedGradSync` instead copies each parameter's grad into a
bucket as soon as autograd has accumulated it, and starts the bucket's asynchronous all-reduce as soon as the bucket
is full, while backward still computes the grads of earlier layers. :meth:`OverlappedGradSync.finish` waits for the
reductions and writes the averaged grads back.

Buckets are cut from the parameters in reverse registration order, which is about the order backward produces their
grads. They launch strictly in index order, so every dp rank issues the same collectives in the same order (a
requirement of gloo and NCCL) even where autograd finishes grads in a slightly different order.

Parameters are plain tensors or DTensors on the tp mesh; a DTensor grad is reduced as its local shard, which is what
each dp replica of that tp rank owns. FSDP2-sharded models reduce their own grads and do not need this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshpar._compat import DeviceMesh
from meshpar._compat import local_tensor as _local
from meshpar._dp_checks import check_same_across_dp, refuse_dp_sharded


def grad_buffer(numels: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat dp-reduction buffer for grads of ``numels`` elements, followed by one "has a grad" flag per
    parameter (see :func:`pack_grads`)."""
    return torch.empty(sum(numels) + len(numels), dtype=dtype, device=device)


def pack_grads(params: list[torch.nn.Parameter], buffer: torch.Tensor) -> bool:
    """Copy each parameter's local grad into its piece of ``buffer`` (zeros where it has none, so the sizes match on
    every rank) and set its flag; returns whether this rank lacked some grad. A parameter unused on some dp ranks (an
    expert no token of their batch reached) then gets the dp mean everywhere (:func:`unpack_grads`)."""
    views = buffer.split([*(_local(p).numel() for p in params), len(params)])
    missing = False
    for param, view in zip(params, views, strict=False):
        if param.grad is None:
            view.zero_()
            missing = True
        else:
            view.copy_(_local(param.grad).reshape(-1))
    if missing:
        views[-1].copy_(torch.tensor([p.grad is not None for p in params], dtype=buffer.dtype))
    else:
        views[-1].fill_(1.0)  # no host-to-device copy in the common case
    return missing


def unpack_grads(params: list[torch.nn.Parameter], buffer: torch.Tensor, missing: bool) -> None:
    """Write the reduced grads of a :func:`pack_grads` buffer back into each ``param.grad``; a parameter without a
    grad here gets one where another rank had it, and keeps ``None`` where no rank had one. The flags are read back
    (a device sync) only where this rank lacked some grad."""
    views = buffer.split([*(_local(p).numel() for p in params), len(params)])
    present = views[-1].tolist() if missing else None
    for i, (param, view) in enumerate(zip(params, views, strict=False)):
        if param.grad is None:
            if not present or present[i] == 0:
                continue
            param.grad = torch.zeros_like(param)
        grad = _local(param.grad)
        grad.copy_(view.view_as(grad))


@dataclass
class _Bucket:
    """Consecutive parameters whose grads travel in one all-reduce of one flat buffer."""

    params: list[torch.nn.Parameter]
    numels: list[int]
    dtype: torch.dtype
    device: torch.device
    ready: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    missing: bool = False  # a parameter of this bucket had no grad on this rank at launch

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)


class OverlappedGradSync:
    """Averages the grads of ``parameters`` over the dp group while backward runs.

    Call :meth:`finish` after each backward that should sync (it launches whatever backward did not, for example
    buckets holding unused parameters, and waits); run the backwards of earlier gradient-accumulation microbatches
    under :meth:`no_sync`. ``bucket_mb`` caps a bucket's size in MiB (``first_bucket_mb`` the first one's, the last
    layers' grads): smaller buckets start earlier but cost more collectives. A single parameter larger than the cap
    gets a bucket of its own. ``reduce_dtype=torch.float32`` reduces bf16/fp16 grads in fp32. ``divisor`` (default:
    the group's size) divides the sum: dp, when the group is dp x cp (:attr:`ParallelDims.grad_mesh`).
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        dp_mesh: DeviceMesh,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        reduce_dtype: torch.dtype | None = None,
        divisor: int | None = None,
    ) -> None:
        if not (bucket_mb > 0 and first_bucket_mb > 0):
            raise ValueError(f"bucket_mb and first_bucket_mb must be positive, got {bucket_mb!r}, {first_bucket_mb!r}")
        self._size = dp_mesh.size()
        self._divisor = self._size if divisor is None else divisor  # dp alone when the group is dp x cp
        self._group = dp_mesh.get_group() if self._size > 1 else None
        self._reduce_dtype = reduce_dtype
        self._sync = True
        self._next = 0  # the first bucket not launched yet
        unique = {id(p): p for p in parameters if p.requires_grad}
        refuse_dp_sharded(unique.values(), "OverlappedGradSync")
        caps = (int(min(first_bucket_mb, bucket_mb) * 2**20), int(bucket_mb * 2**20))
        self._buckets = self._cut(list(unique.values())[::-1], caps)
        self._slot = {id(p): (b, i) for b, bucket in enumerate(self._buckets) for i, p in enumerate(bucket.params)}
        if self._size > 1:
            self._check_same_buckets()
        self._handles = (
            [p.register_post_accumulate_grad_hook(self._on_grad) for p in unique.values()] if self._size > 1 else []
        )

    def _cut(self, params: list[torch.nn.Parameter], caps: tuple[int, int]) -> list[_Bucket]:
        """Greedy cut in backward order; the first bucket gets the smaller cap so the first all-reduce starts early
        (torch DDP does the same)."""
        buckets: list[_Bucket] = []
        for param in params:
            local = _local(param)
            dtype = self._reduce_dtype or local.dtype
            last = buckets[-1] if buckets else None
            cap = caps[0] if len(buckets) == 1 else caps[1]
            fits = last is not None and (sum(last.numels) + local.numel()) * dtype.itemsize <= cap
            if last is None or not fits or (last.dtype, last.device) != (dtype, local.device):
                last = _Bucket([], [], dtype, local.device)
                buckets.append(last)
            last.params.append(param)
            last.numels.append(local.numel())
        return buckets

    def _check_same_buckets(self) -> None:
        """Every dp rank must cut identical buckets, or the all-reduces would pair buffers of different sizes (a hang
        or garbage): compare once, here, and fail on every rank with each rank's layout."""
        check_same_across_dp(
            [(str(b.dtype), b.numels) for b in self._buckets],
            self._group,
            self._size,
            lambda lay: f"{len(lay)} buckets, {sum(sum(n) for _, n in lay)} elements",
            "their grad buckets",
        )

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def bucket_numels(self) -> list[int]:
        """Elements per bucket, in launch order (the last layers' grads first)."""
        return [sum(bucket.numels) for bucket in self._buckets]

    @property
    def launched(self) -> int:
        """How many buckets' all-reduces are in flight (started during backward, before :meth:`finish`)."""
        return self._next

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate grads locally (gradient accumulation); the next synced backward, or
        :meth:`finish`, reduces the accumulated sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        index, slot = self._slot[id(param)]
        bucket = self._buckets[index]
        if bucket.work is not None:
            raise RuntimeError(
                "a grad changed after its bucket's dp all-reduce had started: call finish() after each synced "
                "backward, and run the backwards of earlier gradient-accumulation microbatches under no_sync()"
            )
        if not self._sync:
            return
        bucket.ready.add(slot)
        while self._next < len(self._buckets) and self._buckets[self._next].full:
            self._launch(self._buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = grad_buffer(bucket.numels, bucket.dtype, bucket.device)
        bucket.missing = pack_grads(bucket.params, bucket.buffer)
        bucket.buffer.div_(self._divisor)  # average before the reduction: nothing left to do after the last wait
        bucket.work = dist.all_reduce(bucket.buffer, group=self._group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets backward did not fill, wait for all, and write the dp-mean into each ``param.grad``
        (parameters no dp rank had a grad for keep ``None``)."""
        if self._size == 1:
            return
        for bucket in self._buckets[self._next :]:
            self._launch(bucket)
        try:
            for bucket in self._buckets:
                bucket.work.wait()
                unpack_grads(bucket.params, bucket.buffer, bucket.missing)
        finally:
            for bucket in self._buckets:
                bucket.ready.clear()
                bucket.work = None
            self._next = 0

    def remove(self) -> None:
        """Unregister the hooks (grads then stay local until someone reduces them)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
