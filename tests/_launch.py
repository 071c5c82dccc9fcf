"""Run a script as a user would: under ``torchrun`` (gloo on CPU), or with plain ``python``."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

from meshpar.testing._harness import shutdown_pools

ROOT = Path(__file__).resolve().parents[1]
_RUNNER = Path(__file__).resolve().parent / "_run_script.py"
# the line each launched process prints once its script and exit handlers finished
MARKER = runpy.run_path(str(_RUNNER), run_name="_run_script")["MARKER"]

# torch's gloo worker threads can abort a process after the script and its exit handlers finished, during Python's
# finalisation (a worker dropping its last reference to a finished collective's tensor needs the GIL then:
# pytorch#190489); torchrun then stops the other ranks with SIGTERM
_FINALISATION_ABORT = "terminate called without an active exception"
_EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def launch(
    script: str | Path,
    *args: str,
    nproc: int | None,
    cwd: Path,
    launcher: tuple[str, ...] = (),
    env: dict | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc [launcher...] script args`` (plain ``python`` when ``nproc``
    is None; the script run by ``tests/_run_script.py``, as python runs it), one thread per process, meshpar
    importable from this checkout; the finished process.

    A run whose every process finished its script and exit handlers, and which failed only because a process
    aborted afterwards in Python's finalisation (see ``_FINALISATION_ABORT``), is returned with exit status 0 and a
    line saying so appended to its stderr: what the script did is what the test judges."""
    # the shared worker pools sit idle meanwhile, but their gloo groups' transport threads still poll: closed, they
    # leave the cores to the launched processes (the next pooled test starts fresh workers in a fraction of a second)
    shutdown_pools()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("TRITON_INTERPRET", None)  # the scripts run as users run them: compiled kernels where there is a GPU
    command = [sys.executable, str(_RUNNER), str(script), *args]
    if nproc is not None:
        run = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher]
        command = [sys.executable, *run, str(_RUNNER), str(script), *args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 and _aborted_only_in_finalisation(result, nproc or 1):
        result.stderr += f"\n[tests] exit status {result.returncode} taken as 0: every rank finished, then one aborted"
        result.stderr += " in Python's finalisation (torch's gloo worker threads, pytorch#190489)\n"
        result.returncode = 0
    return result


def _aborted_only_in_finalisation(result: subprocess.CompletedProcess, nproc: int) -> bool:
    """Every rank printed the finished line, a process aborted with the worker threads' message, and every exit
    status torchrun reports is that abort (SIGABRT) or its own SIGTERM to the other ranks."""
    output = result.stdout + result.stderr
    finished = set(re.findall(re.escape(MARKER) + r" (\d+)", output))
    if finished != {str(rank) for rank in range(nproc)} or _FINALISATION_ABORT not in output:
        return False
    if nproc == 1 and result.returncode == -6:  # plain python (torchrun itself exits 1)
        return True
    codes = {int(code) for code in _EXIT_CODE.findall(result.stderr)}
    return -6 in codes and codes <= {-6, -15}
