"""Save / load / re-save correct under any scheduling (meshpar.testing.stress): random delays on every rank before
each barrier, broadcast, agreement, DCP call and file operation, at world 4 in two layouts; and a failure injected at
a random step on a random rank ends every rank, never a hang. The long run is by hand:
``python -m meshpar.testing.stress --iterations 300``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from meshpar.testing import run_distributed
from meshpar.testing.stress import checkpoint_stress

pytestmark = pytest.mark.slow  # not in make test-fast: many save / load iterations with delays

LAYOUTS = {"tp2xpp2": {"tp": 2, "pp": 2}, "tp2xdp2": {"tp": 2, "dp": 2}}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoints_are_right_under_random_delays(tmp_path: Path, layout: str) -> None:
    for seed in range(2):
        delayed = run_distributed(checkpoint_stress, 4, str(tmp_path / str(seed)), LAYOUTS[layout], 6, seed, 0.02)
        assert min(delayed) >= 6 * 8, delayed  # every iteration delayed each rank at 8 steps or more


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_failure_at_a_random_step_ends_every_rank(tmp_path: Path, seed: int) -> None:
    """Either every rank raises (the failing one its injected error, the others PeerFailedError or the shared
    refusal the failure turned into), or, where the failed step was one whose outcome every rank agrees on, all
    raise alike; no rank is left without an answer."""
    rng = random.Random(seed)
    fail = (rng.randrange(4), rng.randrange(8))  # every rank runs at least 8 delayed steps an iteration
    with pytest.raises(AssertionError) as caught:
        run_distributed(checkpoint_stress, 4, str(tmp_path), LAYOUTS["tp2xpp2"], 2, seed, 0.02, fail)
    report = str(caught.value)
    assert "no answer" not in report and "process died" not in report and "Timed out" not in report, report
    per_rank = report.split("\nrank ")[1:]
    assert len(per_rank) == 4, report
    assert "InjectedFailureError" in report, report
