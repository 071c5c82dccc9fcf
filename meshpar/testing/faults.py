"""Crash a checkpoint save at a chosen step of its protocol (test-only: production code has no hooks).

:func:`kill_at` patches the functions rank 0 calls while it places a save (:func:`meshpar.checkpoint._place`) so
that this process dies by SIGKILL, with no cleanup, at one of the points that matter for crash safety:

- ``"written"``: every rank has written its shards, nothing of the placing has run;
- ``"manifest"``: the manifest is written, the temporary directory not yet renamed;
- ``"placed"``: the copy sits under its final name, ``latest`` still names the previous one;
- ``"pointed"``: ``latest`` names the new copy, older copies of the step not yet removed;
- ``"retired"``: the save is complete.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from meshpar import checkpoint

KILL_POINTS = ("written", "manifest", "placed", "pointed", "retired")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _around(
    original: Callable[..., Any], before: Callable[..., bool] | None = None, after: Callable[..., bool] | None = None
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if before is not None and before(*args, **kwargs):
            _die()
        result = original(*args, **kwargs)
        if after is not None and after(*args, **kwargs):
            _die()
        return result

    return run


def _writes_latest(path: Path, *_: Any, **__: Any) -> bool:
    return Path(path).name == checkpoint.LATEST


@contextlib.contextmanager
def kill_at(point: str) -> Iterator[None]:
    """Within this block, a checkpoint save kills this process at ``point`` (one of :data:`KILL_POINTS`)."""
    always: Callable[..., bool] = lambda *_, **__: True  # noqa: E731
    patches = {
        "written": (checkpoint, "add_dcp_aliases", {"before": always}),
        "manifest": (os, "rename", {"before": always}),
        "placed": (checkpoint, "_write_atomic", {"before": _writes_latest}),
        "pointed": (checkpoint, "_write_atomic", {"after": _writes_latest}),
        "retired": (checkpoint, "_place", {"after": always}),
    }
    if point not in patches:
        raise ValueError(f"unknown kill point {point!r}; expected one of {KILL_POINTS}")
    owner, name, when = patches[point]
    with mock.patch.object(owner, name, _around(getattr(owner, name), **when)):
        yield
