"""The README's main job runs end to end (a short run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, script: str, *args: str, tmp_path: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        script,
        *args,
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_train_gpt_tp2_pp2_end_to_end(tmp_path: Path) -> None:
    out = _torchrun(4, "examples/train_gpt.py", "--steps", "3", "--out", str(tmp_path), tmp_path=tmp_path)
    assert "step    3 | loss" in out and "-> OK" in out
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "merged" / "config.json").exists()


@pytest.mark.slow
def test_train_tp_example(tmp_path: Path) -> None:
    out = _torchrun(2, "examples/train_tp.py", "--steps", "3", tmp_path=tmp_path)
    assert "step   3 | loss" in out
