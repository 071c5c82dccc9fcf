"""Every code block of README.md and docs/*.md runs as written.

A Python block runs as a script in a fresh folder: under torchrun when its first line says
``# torchrun --nproc-per-node N`` (gloo on CPU, as a user would start it), else with plain ``python``. A bash block
may only hold commands another test or CI runs (listed below with what runs them), so that none goes stale unseen.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._launch import ROOT, launch

pytestmark = pytest.mark.slow  # not in make test-fast: each block runs under torchrun in fresh processes

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
_TORCHRUN = re.compile(r"#\s*torchrun --nproc-per-node (\d+)")

# bash commands the docs show -> what runs them
BASH_COVERED = {
    "make train": "tests/test_examples.py (examples/train_gpt.py, the job make train starts)",
    "make test": "CI (.ci/run)",
    'make train ARGS="--resume"': "tests/test_examples.py (a killed rank's job resumes from latest)",
    ".venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 3 "
    "examples/train_gpt.py --save-every 10": "tests/test_examples.py (torchrun --max-restarts, a rank killed)",
}


def _blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for index, match in enumerate(_BLOCK.finditer(doc.read_text())):
            if match.group(1) == language:
                found.append((f"{doc.relative_to(ROOT)}#{index}", match.group(2)))
    return found


@pytest.mark.parametrize(("where", "code"), _blocks("python"), ids=[w for w, _ in _blocks("python")])
def test_python_block_runs_as_written(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    launcher = _TORCHRUN.match(code.splitlines()[0]) if code.strip() else None
    nproc = int(launcher.group(1)) if launcher else None
    result = launch(script, nproc=nproc, cwd=tmp_path, timeout=1800)
    assert result.returncode == 0, f"{where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def test_every_bash_command_is_run_elsewhere() -> None:
    for where, code in _blocks("bash"):
        for line in code.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                assert command in BASH_COVERED, f"{where}: {command!r} is run by no test; add one"
