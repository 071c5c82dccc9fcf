"""One rank's failure stops every rank: no peer is left blocked in a collective until the timeout.

meshpar's collective phases (``parallelize``, a pipeline schedule, a checkpoint save or load) run inside
:func:`stop_all_ranks_on_error`. When an exception leaves the phase on one rank, that rank writes what happened to the
job's rendezvous store and aborts all its process groups. Its peers, blocked in a recv or collective with it, fail
within milliseconds with a connection error; their own guard turns that into :class:`PeerFailedError`, which names the
rank that failed first and its error, and aborts their groups in turn, so the stop spreads through every group
(a rank waiting only on a peer of a peer stops too). Every rank then raises: the failing rank its own exception,
the others ``PeerFailedError``.

The process groups are gone afterwards (``torch.distributed.is_initialized()`` is false): the job ends with an
error on every rank, and a launcher with restarts (``torchrun --max-restarts``) starts it again from the latest
checkpoint. A refusal that every rank raises alike ends the job the same way; nothing waits for a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist

from meshpar._compat import abort_all_process_groups, default_store

logger = logging.getLogger(__name__)

_FAILURE_KEY = "meshpar/first_failure"


class PeerFailedError(RuntimeError):
    """Raised on a rank that stopped because another rank failed."""


def first_failure_on_any_rank(problem: str | None, group: dist.ProcessGroup | None = None) -> tuple[int, str] | None:
    """``(rank in group, its problem)`` of the first rank of ``group`` that found one, on every rank (``None``: all
    fine). For refusals that one rank detects alone (its own file, its own shards): every rank raises alike instead
    of the others walking into a collective the failing rank never joins. No-op without a process group."""
    if not dist.is_initialized():
        return (0, problem) if problem is not None else None
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next(((rank, p) for rank, p in enumerate(problems) if p is not None), None)


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


def _stop(store: dist.Store | None) -> None:
    """Abort this rank's process groups and close its connections to the peers (not to the store)."""
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
    """Run a collective phase; on an exception, stop every rank of the job (see the module docstring)."""
    try:
        yield
    except BaseException as error:
        if getattr(error, "_meshpar_stopped", False) or not dist.is_initialized():
            raise  # an inner phase has already stopped the job, or there is no job to stop
        rank = dist.get_rank()
        store = default_store()
        if _is_peer_loss(error):
            cause = _recorded_failure(store) or f"a peer rank stopped ({type(error).__name__}: {str(error)[:200]})"
            stop = PeerFailedError(f"rank {rank} stopped during {phase} because {cause}")
            stop._meshpar_stopped = True
            _stop(store)
            raise stop from error
        _record_failure(store, f"rank {rank} failed during {phase}: {type(error).__name__}: {error}")
        logger.error("rank %d failed during %s; aborting its process groups so that every rank stops", rank, phase)
        _stop(store)
        error._meshpar_stopped = True
        error.add_note(f"meshpar: rank {rank} failed during {phase}; every rank of the job was stopped")
        raise
