"""torchrun target for the restart test: run a script, SIGKILLing one rank right after its N-th ``train_step`` in
the job's first attempt (a restarted attempt runs through). The kill is patched in here, so the example itself
carries no fault-injection hook.

Usage: ``torchrun ... tests/_kill_after.py RANK:STEPS script.py [args...]``
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any

from meshpar.hf.parallelize import ParallelizedModel


def main() -> None:
    spec, script, *args = sys.argv[1:]
    rank, steps = (int(part) for part in spec.split(":"))
    original = ParallelizedModel.train_step
    calls = 0

    def train_step(self: ParallelizedModel, *a: Any, **k: Any) -> Any:
        nonlocal calls
        loss = original(self, *a, **k)
        calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if calls == steps and first_attempt and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    ParallelizedModel.train_step = train_step
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
