"""``triton`` and ``triton.language`` for the kernel modules, or stand-ins where triton is not installed.

Without triton (macOS, some CPU-only installs) ``import meshpar`` must still work: the ``@triton.jit`` kernels are
then kept as plain, never-launched functions, and every op runs its torch reference (``_dispatch.run_triton`` is
false). Anything else touched on the stand-ins raises with the reason.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:

    class _Missing:
        def __init__(self, name: str) -> None:
            self._name = name

        def jit(self, fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, attr: str) -> Any:
            raise RuntimeError(f"{self._name}.{attr} needs the triton package, which is not installed")

    triton = _Missing("triton")
    tl = _Missing("triton.language")

__all__ = ["tl", "triton"]
