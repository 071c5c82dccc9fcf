"""The launcher the docs and examples tests use: a process that aborts in Python's finalisation after its script
finished is told apart from one that did not finish (pytorch#190489, see tests/_launch.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests._launch import launch

# a process that aborts as torch's gloo workers do: in finalisation, once the module's globals are cleared
_ABORT_IN_FINALISATION = """
import os, sys

class _AbortsWhenCollected:
    def __del__(self):
        sys.stderr.write("terminate called without an active exception\\n")
        sys.stderr.flush()
        os.abort()
"""


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "script.py"
    script.write_text(_ABORT_IN_FINALISATION + textwrap.dedent(body))
    return script


def test_a_script_that_finished_then_aborted_in_finalisation_counts_as_finished(tmp_path: Path) -> None:
    result = launch(_script(tmp_path, "bomb = _AbortsWhenCollected()\nprint('done')\n"), nproc=None, cwd=tmp_path)
    assert result.returncode == 0 and "done" in result.stdout
    assert "taken as 0" in result.stderr


@pytest.mark.parametrize(
    "body",
    [
        "bomb = _AbortsWhenCollected()\nraise ValueError('the script failed')\n",  # failed, then aborted
        "_AbortsWhenCollected().__del__()\n",  # aborted while the script ran
        "import sys\nbomb = _AbortsWhenCollected()\nsys.exit(3)\n",  # the script's own status stands
        "bomb = _AbortsWhenCollected()\nraise SystemExit('a message is status 1')\n",
    ],
    ids=["raised", "aborted_while_running", "exit_status", "system_exit"],
)
def test_a_script_that_did_not_finish_keeps_its_failure(body: str, tmp_path: Path) -> None:
    result = launch(_script(tmp_path, body), nproc=None, cwd=tmp_path)
    assert result.returncode != 0 and "taken as 0" not in result.stderr


@pytest.mark.parametrize("rank_0_finishes", [True, False])
def test_under_torchrun_every_rank_must_have_finished(rank_0_finishes: bool, tmp_path: Path) -> None:
    """Rank 1 aborts in finalisation; torchrun stops rank 0 with SIGTERM. Taken as finished only when rank 0 had
    finished too (else it waits for a signal, and it is torchrun's SIGTERM that ends it). When rank 0 finishes, rank 1
    waits until rank 0's process has ended (its pid in a file; no timing): on a loaded machine rank 1 could otherwise
    abort before rank 0 got through its start-up, and torchrun's SIGTERM would end a rank 0 that never ran."""
    rank_0 = "pass" if rank_0_finishes else "import signal; signal.pause()"
    body = f"""
    import pathlib, time
    pid_file = pathlib.Path("rank0.pid")
    if os.environ["RANK"] == "1":
        while {rank_0_finishes}:  # until rank 0's process has ended (gone, or a zombie torchrun has not reaped)
            if pid_file.exists() and pid_file.read_text():
                stat = pathlib.Path(f"/proc/{{pid_file.read_text()}}/stat")
                if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        bomb = _AbortsWhenCollected()
    else:
        pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
        pid_file.with_suffix(".tmp").rename(pid_file)
        {rank_0}
    """
    result = launch(_script(tmp_path, body), nproc=2, cwd=tmp_path)
    assert (result.returncode == 0) == rank_0_finishes, result.stderr[-3000:]
