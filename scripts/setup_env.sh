#!/usr/bin/env bash
# Create .venv with meshpar and its test tools. Picks the CPU build of torch where there is no NVIDIA GPU, so a
# CPU machine never downloads a multi-GB CUDA build. Idempotent: re-running with an unchanged pyproject does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.meshpar-installed
WANT=$(cat pyproject.toml scripts/setup_env.sh | sha1sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.11"
  else
    # The CPU wheel: found locally where pip's configuration names a wheel cache, else on PyTorch's CPU index.
    "${PIP[@]}" "torch==2.13.0+cpu" 2>/dev/null ||
      "${PIP[@]}" --retries 1 --timeout 30 --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
  fi
fi
"${PIP[@]}" --no-build-isolation -e ".[dev]"
echo "$WANT" > "$STAMP"
