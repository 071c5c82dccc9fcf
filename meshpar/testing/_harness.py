"""A persistent pool of gloo worker processes that runs test functions on every rank.

Starting processes and importing torch costs seconds, so each world size gets one pool per test session, its
workers forked from a server that imported torch, transformers and meshpar once (a pool rebuilt after a failure
starts at once); every call sends a picklable (module-level) function to all ranks and returns the per-rank results.
A failure on any rank raises with every rank's traceback; a rank that does not answer within the timeout is treated
as a hang, and one whose process died is reported with its exit code: either way the pool is killed (and rebuilt by
the next call) instead of blocking the test session.

A worker serves many tests, so a case that replaces a meshpar function, class or method (a test's stub) and does
not put it back would change every later case in that worker: the worker puts back whatever a case left replaced and
fails that case, naming what it left.

Workers are recycled as they age: every process group a case makes lives on in the worker (meshpar reuses its
meshes; tests and views make groups of their own), and each gloo group keeps a transport thread that wakes every
few milliseconds, so a worker holding a hundred groups burns a sixth of a core while idle, slowing every later test.
Each reply carries the worker's thread count; a pool past :data:`_RECYCLE_THREADS` is closed after its call
(failed or not), and the next call starts fresh workers from the fork server (a fraction of a second).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

# No wall-clock bound may decide a result on a loaded machine (CI's 2 cores have run at a load average of 80): a
# collective waits up to 10 minutes for a slow peer, a call up to 10 minutes for every rank's answer, and once one
# rank has failed the others get 2 minutes to report theirs. Only a real hang comes near these; pytest's own
# per-test limit (15 minutes) stays above them.
_GLOO_TIMEOUT_S = 600
_ANSWER_TIMEOUT_S = 600.0
_AFTER_FAILURE_TIMEOUT_S = 120.0
# how long a hung rank's report waits for the Python stacks it is asked to write (diagnostics only: a report without
# them says so; no result depends on it)
_STACKS_WAIT_S = 10.0
# the signal a hung rank is sent to write every thread's Python stack (faulthandler), where the platform has it
_STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)
# a worker's threads beyond which its pool is recycled after a call (about three per live gloo group). Not lower: a
# fresh pool rebuilds the meshes later cases reuse.
_RECYCLE_THREADS = 160

# imported once by the fork server that starts every worker: a pool respawned after a failure test (its process
# groups aborted) starts in a fraction of a second instead of importing torch and transformers again in each process
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers", "meshpar", "meshpar.hf"]


def _process_context() -> mp.context.BaseContext:
    """``forkserver`` with the imports above done once (CUDA is never touched before the fork: the server only
    imports); ``spawn`` where there is no fork server (not POSIX)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _ParentState:
    """Stands for the creating process's stdout, stderr and environment as they are when a pool starts: pickled into
    a worker, it becomes copies of those descriptors and that environment, which the worker makes its own, as a
    spawned worker inherits them (a forked one would otherwise write where the fork server's output went, e.g. the
    captured output of whichever test started the server, and see the server's environment). Modules the server
    imported read their environment then (``TRITON_INTERPRET``, set by tests/conftest.py before any pool)."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_InheritedState, (DupFd(1), DupFd(2), dict(os.environ)))


class _InheritedState:
    def __init__(self, stdout: Any, stderr: Any, environment: dict[str, str]) -> None:
        self.stdout, self.stderr, self.environment = stdout, stderr, environment

    def install(self) -> None:
        for wrapper, target in ((self.stdout, 1), (self.stderr, 2)):
            fd = wrapper.detach()
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(self.environment)


_CODE = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type, staticmethod, classmethod, property)


def _bound_code() -> list[tuple[object, str, object]]:
    """Every function, class, method and module bound in a meshpar module or on a class one defines: what a test
    case's stub would replace."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "meshpar" or name.startswith("meshpar.")):
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("__"):  # the interpreter's and torch.compile's own (``__compiled_fn_*``) come and go
                continue
            if isinstance(value, _CODE):
                found.append((module, attr, value))
            if isinstance(value, type) and value.__module__ == name:
                found.extend((value, key, item) for key, item in list(vars(value).items()) if isinstance(item, _CODE))
    return found


def _wraps(now: object, original: object) -> bool:
    """Whether ``now`` wraps ``original`` (``functools.wraps``' ``__wrapped__`` chain): what libraries do for good,
    as torch's optimizers to their class's ``step`` (profiling hooks), not a test's stub."""
    for _ in range(16):
        now = getattr(now, "__wrapped__", None)
        if now is None:
            return False
        if now is original:
            return True
    return False


def _put_back(bound: list[tuple[object, str, object]]) -> list[str]:
    """Rebind whatever a case replaced (or deleted) of ``bound``; the names it left changed."""
    missing = object()
    changed = []
    for owner, attr, value in bound:
        now = vars(owner).get(attr, missing)
        if now is not value and not _wraps(now, value):
            setattr(owner, attr, value)
            module = isinstance(owner, types.ModuleType)
            changed.append(f"{owner.__name__ if module else f'{owner.__module__}.{owner.__qualname__}'}.{attr}")
    return changed


def _worker_main(
    rank: int, world_size: int, port: int, conn: Connection, parent: _InheritedState, stacks_path: str
) -> None:
    parent.install()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # a rank killed by a signal (an abort in native code) prints every thread's Python stack to stderr first
    faulthandler.enable(all_threads=True)
    # a rank that does not answer is asked for its stacks (into its own file, which the hang report quotes)
    stacks = open(stacks_path, "w")  # noqa: SIM115 - open for the worker's life: faulthandler writes to it
    if _STACKS_SIGNAL is not None:
        faulthandler.register(_STACKS_SIGNAL, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    torch.seed()  # forked from one server: give each rank its own unseeded generator, as a fresh process has
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=_GLOO_TIMEOUT_S)
    )
    from meshpar.parallel_dims import destroy_parallel

    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        bound = _bound_code()
        try:
            result = fn(*args, **kwargs)
            # fn caught an error after meshpar.failure aborted the process groups: the pool must be rebuilt
            reply = ("ok" if dist.is_initialized() else "ok, process groups aborted", result)
        except BaseException:
            # meshpar.failure aborts the process groups when a collective phase fails: the pool must be rebuilt
            aborted = "" if dist.is_initialized() else "\n[process groups aborted]"
            reply = ("error", traceback.format_exc() + aborted)
        finally:
            destroy_parallel()
        left = _put_back(bound)
        if left and reply[0] != "error":
            reply = ("error", f"{fn.__qualname__} left {left} replaced in the worker, which serves later tests: put "
                     "them back in a finally (the worker has)")  # fmt: skip
        conn.send((*reply, _thread_count()))
    if dist.is_initialized():
        dist.destroy_process_group()


def _thread_count() -> int:
    """This process's threads, native ones (gloo's) included where the OS lists them; Python's own elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _exit_reason(code: int | None) -> str:
    """``exit code 1``, or the signal's name for a process a signal killed (``SIGABRT``: an abort in native code,
    whose Python stacks faulthandler printed to the test's captured stderr)."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}; its Python stacks are in the captured stderr"
    return f"exit code {code}"


class RankCrashedError(AssertionError):
    """A rank's process was killed by a signal (an abort or a fault in native code), not by a Python error."""


class DistributedPool:
    """``world_size`` gloo processes waiting for functions to run."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = _process_context()
        port = _free_port()
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._stacks_dir = tempfile.mkdtemp(prefix="meshpar-pool-")
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, port, child, _ParentState(), self._stacks_path(rank))
            proc = ctx.Process(target=_worker_main, args=args, daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.broken = False
        self.threads = 0  # the most threads any worker has reported (a worker's threads only grow)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = _ANSWER_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        if self.broken:
            raise RuntimeError("this pool was killed after a failure; use a new one")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        hung = aborted = crashed = False
        # answers are taken as they come, so a rank that fails is seen at once even while a lower rank waits on it in
        # a collective; from the first failure on, the others get the after-failure time left, not the full timeout
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            ready = mp_connection.wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in [r for r, conn in pending.items() if conn in ready]:
                conn = pending.pop(rank)
                try:
                    status, payload, threads = conn.recv()
                    self.threads = max(self.threads, threads)
                except (EOFError, ConnectionError):  # the process died (a signal, an abort in native code)
                    self._procs[rank].join(timeout=5)
                    code = self._procs[rank].exitcode
                    failures[rank] = f"rank {rank}: the process died ({_exit_reason(code)})"
                    hung, crashed = True, crashed or (code is not None and code < 0)
                else:
                    if status.startswith("ok"):
                        results[rank] = payload
                        aborted = aborted or status != "ok"
                        continue
                    failures[rank] = f"rank {rank}:\n{payload}"
                    # a gloo timeout or meshpar's abort leaves the group unusable
                    hung = hung or "Timed out waiting" in payload or "[process groups aborted]" in payload
                deadline = min(deadline, time.monotonic() + _AFTER_FAILURE_TIMEOUT_S)
        stacks = self._hung_stacks(list(pending))
        for rank in pending:
            failures[rank] = (
                f"rank {rank}: no answer in time (hang or deadlock{', after a failure' if failures else ''})"
                f"{stacks[rank]}"
            )
            hung = True
        errors = [failures[rank] for rank in sorted(failures)]
        if errors:
            if hung:  # a rank may be stuck in a collective: the process group cannot be trusted any more
                self.close(force=True)
            error = RankCrashedError if crashed else AssertionError
            raise error(f"{fn.__name__} failed on world size {self.world_size}:\n" + "\n".join(errors))
        if aborted:
            self.close(force=True)
        return results

    def _stacks_path(self, rank: int) -> str:
        return os.path.join(self._stacks_dir, f"rank{rank}.stacks")

    def _hung_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each hung rank's Python stacks (faulthandler's dump, asked for by signal), as a report's tail: where it
        waits is what a hang report needs, and the workers' stderr may be another test's captured output."""
        if not ranks or _STACKS_SIGNAL is None:
            return dict.fromkeys(ranks, "")
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, _STACKS_SIGNAL)
        deadline, sizes = time.monotonic() + _STACKS_WAIT_S, {}
        while time.monotonic() < deadline:
            now = {rank: os.path.getsize(self._stacks_path(rank)) for rank in ranks}
            if all(now.values()) and now == sizes:  # every dump written and no longer growing
                break
            sizes = now
            time.sleep(0.2)
        out = {}
        for rank in ranks:
            with open(self._stacks_path(rank)) as file:
                text = file.read().strip()
            out[rank] = f"; its Python stacks:\n{text}" if text else "; it wrote no Python stacks when asked"
        return out

    def close(self, force: bool = False) -> None:
        self.broken = True
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if not force and proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        shutil.rmtree(self._stacks_dir, ignore_errors=True)


_POOLS: dict[int, DistributedPool] = {}


def _pool(world_size: int) -> DistributedPool:
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        pool = _POOLS[world_size] = DistributedPool(world_size)
    return pool


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a gloo group of ``world_size``; returns per-rank results.

    A run in which a rank's process is killed by a signal runs once more in fresh processes, with a warning that
    names the signal (pytest lists it in its warnings summary). CI once saw such a crash: glibc's heap check
    aborted a worker that many earlier tests had used, and it did not recur in several hundred local reruns. The
    rerun keeps a rare native crash from failing the whole suite. A function that crashes every time still fails,
    and every Python error or wrong result fails at once."""
    try:
        return _run_pooled(fn, world_size, *args, **kwargs)
    except RankCrashedError as crash:
        warnings.warn(f"{crash}\n(ran {fn.__name__} again in fresh processes)", RuntimeWarning, stacklevel=2)
    return _run_pooled(fn, world_size, *args, **kwargs)


def _run_pooled(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """One call on the shared pool of ``world_size``, which is recycled afterwards if its workers grew too many
    threads (see the module docstring)."""
    pool = _pool(world_size)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:  # a failed call too: the pool would otherwise sit idle, polling, while others run
        if not pool.broken and pool.threads > _RECYCLE_THREADS:
            pool.close()


@atexit.register
def shutdown_pools() -> None:
    for pool in _POOLS.values():
        if not pool.broken:
            pool.close()
    _POOLS.clear()
