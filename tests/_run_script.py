"""``python tests/_run_script.py SCRIPT ARGS...`` runs SCRIPT as ``python SCRIPT ARGS...`` would (``__main__``, its
folder first on ``sys.path``, ``sys.argv``), then says on stderr that it finished, unless it raised or exited with a
non-zero status. The line is printed by an exit handler registered before the script's own, so it comes after every
one of them (meshpar's tear-down of its process groups among them): what can still go wrong after it is Python's
finalisation, which ``tests/_launch.py`` tells apart with it (torch's gloo worker threads, pytorch#190489).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

MARKER = "[tests] script and exit handlers finished on rank"


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)
    finished: list[bool] = []
    atexit.register(lambda: finished and print(f"{MARKER} {os.environ.get('RANK', '0')}", file=sys.stderr, flush=True))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code in (None, 0):
            finished.append(True)
        raise
    finished.append(True)


if __name__ == "__main__":
    main()
