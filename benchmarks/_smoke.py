"""Run several benchmark scripts in one process, each as ``python benchmarks/<script> <args>`` would, so their worker
pools and imports are paid once (the CI smoke runs in tests/test_benchmarks.py).

Usage: ``python benchmarks/_smoke.py '<json list of [script, arg, ...]>'``. Each script's stdout follows a line
``=== <script> <args>`` (a script that raised prints ``!!! FAILED`` and its traceback there); the exit status is 1
if any script failed.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(script: str, args: list[str]) -> tuple[str, bool]:
    name = Path(script).stem
    module = importlib.import_module(name)
    out, saved_argv = io.StringIO(), sys.argv
    sys.argv = [str(Path(__file__).resolve().parent / script), *args]
    try:
        with contextlib.redirect_stdout(out):
            module.main()
        return out.getvalue(), True
    except BaseException:  # reported in the output; the next script still runs
        return out.getvalue() + "\n!!! FAILED\n" + traceback.format_exc(), False
    finally:
        sys.argv = saved_argv


def main() -> None:
    ok = True
    for script, *args in json.loads(sys.argv[1]):
        start = time.perf_counter()
        text, passed = run(script, args)
        ok &= passed
        print(f"{time.perf_counter() - start:7.1f} s  {script}", file=sys.stderr, flush=True)  # where CI time goes
        print(f"=== {script} {' '.join(args)}\n{text}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
