"""NxD's trainer API on a GPU: the dense-equivalence case of ``test_nxd_trainer.py`` (three steps, clipping, a
checkpoint round trip, one more step), run in a fresh ``torchrun`` process on one GPU with NCCL, without and with
ZeRO-1. The view places the model on ``xm.xla_device()`` (the process's GPU) as NxD places it on its device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_MAIN = """
import sys
import torch.distributed as dist
from tests.compat.test_nxd_trainer import train_case
dist.init_process_group("nccl")
train_case(1, 1, sys.argv[1] == "zero1", False, sys.argv[2])
dist.destroy_process_group()
print("nxd cuda case passed")
"""


@pytest.mark.parametrize("zero1", [False, True])
def test_nxd_trainer_on_one_gpu_with_nccl(zero1: bool, tmp_path) -> None:
    script = tmp_path / "main.py"
    script.write_text(_MAIN)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script),
               "zero1" if zero1 else "plain", str(tmp_path / "ckpt")]  # fmt: skip
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "nxd cuda case passed" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
