"""The README's main job runs end to end (a short run)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from tests._launch import ROOT, launch

pytestmark = pytest.mark.slow  # not in make test-fast: each runs an example under torchrun


def _torchrun(
    nproc: int, script: str, *args: str, tmp_path: Path, launcher: tuple[str, ...] = (), env: dict | None = None
) -> str:
    result = launch(script, *args, nproc=nproc, cwd=ROOT, launcher=launcher, env=env)
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


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_which_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """pp=2 (the tied embedding lives on both stages), a checkpoint every 2 steps; rank 1 is SIGKILLed after step 5.
    torchrun --max-restarts 1 restarts both ranks, which resume from step 4: the losses of every step and the final
    parameters equal those of a run that was never interrupted."""
    from safetensors.torch import load_file

    small = ["--tp", "1", "--pp", "2", "--steps", "6", "--save-every", "2", "--layers", "2", "--hidden", "64",
             "--seq", "32", "--batch", "8", "--microbatches", "2"]  # fmt: skip
    _torchrun(2, "examples/train_gpt.py", *small, "--out", str(tmp_path / "straight"), tmp_path=tmp_path)
    out = _torchrun(
        2, "tests/_kill_after.py", "1:5", "examples/train_gpt.py", *small, "--out", str(tmp_path / "killed"),
        tmp_path=tmp_path, launcher=("--max-restarts=1",),
    )  # fmt: skip
    assert "after step 4" in out, out[-2000:]
    straight = json.loads((tmp_path / "straight" / "losses.json").read_text())
    killed = json.loads((tmp_path / "killed" / "losses.json").read_text())
    assert len(killed) == 6 and killed == pytest.approx(straight, abs=1e-6)
    a = load_file(str(tmp_path / "straight" / "merged" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "merged" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)


def test_train_gpt_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    """The schedule that keeps the main job's loss from spiking (see the example's docstring): a function of the
    step alone, so a resumed run follows it too."""
    import argparse

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_gpt import lr_at
    finally:
        sys.path.remove(str(ROOT / "examples"))
    args = argparse.Namespace(lr=1e-3, warmup=20, steps=60)
    rates = [lr_at(step, args) for step in range(1, 61)]
    assert rates[0] == pytest.approx(5e-5) and rates[19] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    assert all(a < b for a, b in itertools.pairwise(rates[:20]))
    assert all(a >= b for a, b in itertools.pairwise(rates[19:]))
