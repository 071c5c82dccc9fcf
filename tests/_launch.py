"""Run a script as a user would: under ``torchrun`` (gloo on CPU), or with plain ``python``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    is None), one thread per process, meshpar importable from this checkout; the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("TRITON_INTERPRET", None)  # the scripts run as users run them: compiled kernels where there is a GPU
    command = [sys.executable, str(script), *args]
    if nproc is not None:
        run = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher]
        command = [sys.executable, *run, str(script), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
