"""One rank's failure stops every rank; a refusal every rank reaches together stops none.

meshpar's collective phases (``parallelize``, a pipeline schedule, ``train_step``, a checkpoint save or load,
pipelined ``generate``) run inside :func:`stop_all_ranks_on_error`. Two kinds of error leave such a phase:

- **A shared refusal**: every rank of the job raises it, because the ranks agreed on it in a collective (a corrupt
  or mismatched checkpoint, a plan that fails verification, wrong arguments, found by :func:`agree` or
  :func:`first_failure_on_any_rank`) or because a collective library raised it on every rank (DCP). No rank is left
  blocked, so the process groups stay usable: the caller may catch it and go on (load the previous step, try
  another config). Such errors carry :func:`is_shared_refusal`.
- **An asymmetric failure**: one rank raises while its peers may be blocked in a collective with it. That rank
  writes what happened to the job's rendezvous store and aborts all its process groups. Its peers, blocked in a recv
  or collective with it, fail within milliseconds with a connection error; their own guard turns that into
  :class:`PeerFailedError`, which names the rank that failed first and its error, and aborts their groups in turn,
  so the stop spreads through every group (a rank waiting only on a peer of a peer stops too).

After an abort the process groups are gone, and this process remembers why: every later meshpar call that needs
them raises :class:`ProcessGroupsAbortedError` naming the first failure, instead of running as independent single
processes (a checkpoint written by one rank alone would be wrong). The job ends with an error on every rank, and a
launcher with restarts (``torchrun --max-restarts``) starts it again from the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from meshpar._compat import abort_all_process_groups, default_store

logger = logging.getLogger(__name__)

_FAILURE_KEY = "meshpar/first_failure"
_T = TypeVar("_T")

# Why this process aborted its process groups (None: it never did). Process-wide like torch's own group registry,
# which the abort empties: it is what keeps a later call from mistaking "no process group" for "one process".
_aborted_after: str | None = None


class PeerFailedError(RuntimeError):
    """Raised on a rank that stopped because another rank failed."""


class PeerRefusedError(RuntimeError):
    """Raised on a rank whose own call was fine, because another rank refused the same call (see :func:`agree`)."""


class ProcessGroupsAbortedError(RuntimeError):
    """A meshpar call that needs the job's process groups, after a failure aborted them: restart the job."""


def is_shared_refusal(error: BaseException) -> bool:
    """Whether every rank of the job raised ``error`` together (the process groups are still usable)."""
    return bool(getattr(error, "_meshpar_shared_refusal", False))


def process_groups_aborted() -> bool:
    """Whether this process aborted its process groups after a failure."""
    return _aborted_after is not None


def require_process_groups(what: str) -> None:
    """Raise :class:`ProcessGroupsAbortedError` if this process aborted its process groups after a failure."""
    if _aborted_after is not None:
        raise ProcessGroupsAbortedError(
            f"{what} needs the job's process groups, which were aborted after {_aborted_after}; nothing was run. "
            "Restart the job (torchrun --max-restarts restarts it from the latest checkpoint)"
        )


def first_failure_on_any_rank(problem: str | None, group: dist.ProcessGroup | None = None) -> tuple[int, str] | None:
    """``(rank in group, its problem)`` of the first rank of ``group`` that found one, on every rank (``None``: all
    fine). For refusals that one rank detects alone (its own file, its own shards): every rank raises alike instead
    of the others walking into a collective the failing rank never joins. No-op without a process group. An error
    raised from its answer over the whole job (``group=None``) should be marked with :func:`shared_refusal`."""
    require_process_groups("an agreement between ranks")
    if not dist.is_initialized():
        return (0, problem) if problem is not None else None
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next(((rank, p) for rank, p in enumerate(problems) if p is not None), None)


def shared_refusal(error: BaseException) -> BaseException:
    """Mark ``error`` as raised on every rank of the job alike (after an agreement over the whole job), so that
    :func:`stop_all_ranks_on_error` lets it through without aborting the process groups."""
    error._meshpar_shared_refusal = True
    return error


def agree(phase: str, check: Callable[[], _T]) -> _T:
    """Run a rank-local ``check`` (argument and input checks before any collective) and agree on its outcome in one
    small collective over the job: if it raised on any rank, every rank raises (that rank its own error, the others
    :class:`PeerRefusedError` naming it), as a shared refusal; else ``check()``'s result. One rank's bad argument
    then never leaves its peers blocked in a collective it will not join, and the job stays usable."""
    own: Exception | None = None
    try:
        result = check()
    except Exception as error:
        own, result = error, None
    failed = first_failure_on_any_rank(None if own is None else f"{type(own).__name__}: {own}")
    if failed is None:
        return result
    if own is not None:
        raise shared_refusal(own)
    rank, problem = failed
    raise shared_refusal(PeerRefusedError(f"{phase} was refused on rank {rank}: {problem}"))


def collective_phase(phase: str, validate: Callable[..., None] | None = None) -> Callable[[_T], _T]:
    """Decorate a collective function: its arguments are bound to its signature (and given to ``validate``) on every
    rank and agreed on (:func:`agree`) before it runs, then it runs inside :func:`stop_all_ranks_on_error`. A call
    with wrong arguments is refused on every rank and leaves the job usable."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def check(args: tuple, kwargs: dict) -> None:
            bound = signature.bind(*args, **kwargs)
            if validate is not None:
                bound.apply_defaults()
                validate(**bound.arguments)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            require_process_groups(phase)
            with stop_all_ranks_on_error(phase):
                agree(phase, lambda: check(args, kwargs))
                return fn(*args, **kwargs)

        return run

    return decorate


def _record_failure(store: dist.Store | None, report: str) -> None:
    """Record ``report`` as the job's first failure unless another rank got there first."""
    if store is not None:
        with contextlib.suppress(Exception):  # the store may be gone with the rank that hosted it
            store.compare_set(_FAILURE_KEY, "", report)


def _recorded_failure(store: dist.Store | None) -> str | None:
    """The job's first failure, if a rank recorded one."""
    if store is None:
        return None
    with contextlib.suppress(Exception):
        if store.check([_FAILURE_KEY]):
            return store.get(_FAILURE_KEY).decode() or None
    return None


def _store_port(store: dist.Store | None) -> int | None:
    """The TCP port of the job's rendezvous store (its connections stay open: peers read the failure from it)."""
    while store is not None and not isinstance(store, dist.TCPStore):
        store = getattr(store, "underlying_store", None)
    if store is not None:
        return store.port
    port = os.environ.get("MASTER_PORT")
    return int(port) if port else None


def _close_peer_connections(keep_port: int | None) -> None:
    """Shut down this process's connected TCP sockets except the rendezvous store's.

    Gloo has no abort that closes its connections, so a peer blocked in a recv or collective with this rank would
    wait for the group's timeout (30 minutes by default). Shutting the sockets down makes every such peer fail at
    once with "Connection closed by peer", as if this process had exited. Linux only (``/proc/self/fd``); elsewhere
    the peers are released when the process exits."""
    fds = "/proc/self/fd"
    if not os.path.isdir(fds):
        return
    for name in os.listdir(fds):
        try:
            if not os.readlink(f"{fds}/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                ends = {sock.getsockname()[1], sock.getpeername()[1]}  # a listening socket has no peer: OSError
                if keep_port not in ends:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue


def _stop(store: dist.Store | None, why: str) -> None:
    """Abort this rank's process groups and close its connections to the peers (not to the store); remember
    ``why`` so that no later call runs without them (:func:`require_process_groups`)."""
    global _aborted_after
    _aborted_after = _aborted_after or why
    keep = _store_port(store)
    abort_all_process_groups()
    _close_peer_connections(keep)


def _is_peer_loss(error: BaseException) -> bool:
    """A communication error that a peer's abort or exit causes here (connection closed / reset, aborted group)."""
    text = str(error)
    return isinstance(error, (RuntimeError, dist.DistError)) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset", "aborted", "Broken pipe")
    )


@contextlib.contextmanager
def stop_all_ranks_on_error(phase: str) -> Iterator[None]:
    """Run a collective phase; on an exception, stop every rank of the job unless it is a shared refusal (see the
    module docstring). Refuses to start once this process's groups were aborted."""
    require_process_groups(phase)
    try:
        yield
    except BaseException as error:
        if getattr(error, "_meshpar_stopped", False) or is_shared_refusal(error) or not dist.is_initialized():
            raise  # an inner phase has already stopped the job, every rank raises alike, or there is no job
        rank = dist.get_rank()
        store = default_store()
        if _is_peer_loss(error):
            cause = _recorded_failure(store) or f"a peer rank stopped ({type(error).__name__}: {str(error)[:200]})"
            stop = PeerFailedError(f"rank {rank} stopped during {phase} because {cause}")
            stop._meshpar_stopped = True
            _stop(store, cause)
            raise stop from error
        report = f"rank {rank} failed during {phase}: {type(error).__name__}: {error}"
        _record_failure(store, report)
        logger.error("rank %d failed during %s; aborting its process groups so that every rank stops", rank, phase)
        _stop(store, report)
        error._meshpar_stopped = True
        error.add_note(f"meshpar: rank {rank} failed during {phase}; every rank of the job was stopped")
        raise
