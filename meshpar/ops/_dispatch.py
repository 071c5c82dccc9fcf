"""When meshpar's custom ops run their Triton kernels and when their torch references.

Default: Triton on CUDA tensors when Triton imports; the torch reference everywhere else (the CPU kernel). Tests run
the Triton kernels on CPU tensors through the interpreter by setting ``TRITON_INTERPRET=1`` before import and calling
``use_triton(True)``. The env var ``MESHPAR_USE_TRITON=0`` or ``use_triton(False)`` turns the kernels off.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

# a process-wide backend switch, as ``torch.backends.*`` flags are (the ops are called from inside models)
_FORCED: bool | None = None


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(enabled: bool | None) -> None:
    """Force the Triton kernels on (``True``), off (``False``) or back to the automatic choice (``None``)."""
    global _FORCED
    if enabled and not triton_available():
        raise RuntimeError("use_triton(True) needs the triton package")
    _FORCED = enabled


@contextlib.contextmanager
def triton_enabled(enabled: bool | None) -> Iterator[None]:
    previous = _FORCED
    use_triton(enabled)
    try:
        yield
    finally:
        use_triton(previous)


def run_triton(t: torch.Tensor) -> bool:
    """Whether an op whose main input is ``t`` should launch its Triton kernel."""
    if _FORCED is False or os.environ.get("MESHPAR_USE_TRITON") == "0" or not triton_available():
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and interpreting() and _FORCED is True


def block_size(n: int, cap: int = 65536) -> int:
    """The power-of-two block that holds a row of ``n`` elements (Triton needs power-of-two aranges)."""
    size = 1
    while size < n:
        size *= 2
    return min(size, cap)


def num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
