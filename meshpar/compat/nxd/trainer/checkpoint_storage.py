"""``neuronx_distributed.trainer.checkpoint_storage``: where NxD's checkpoints live, as a small storage interface.

:class:`FilesysCheckpointStorage` is a directory (every path relative to it); its writes go to a temporary name
and are renamed into place, so a reader never sees half a file. :class:`S3CheckpointStorage` (``s3://`` paths) is
NxD's S3 backend; it needs boto3 and network access, which meshpar does not bring: constructing one is refused with
that reason, and ``create_checkpoint_storage`` refuses ``s3://`` paths the same way.
"""

from __future__ import annotations

import glob
import math
import os
import random
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MB = 1024**2
SHM_PATH = "/dev/shm"


class BaseCheckpointStorage(ABC):
    def __init__(self, dirname: str) -> None:
        self._dirname = dirname

    def dirname(self) -> str:
        return self._dirname

    def is_checkpoint_xser(self, dirname: str) -> bool:
        """Whether a checkpoint is in torch_xla's split-tensor format (``*.tensors`` next to its files)."""
        found = self.find_subdirs_contain_path("*.tensors", 2, search_root=dirname, max_count=1)
        return len(found) > 0

    def list_checkpoint_tags(self) -> list[str]:
        return self.find_subdirs_contain_path(pattern="checkpoint", search_depth=1, sort_by_mdate=True)

    def list_completed_checkpoint_tags(self) -> list[str]:
        return self.find_subdirs_contain_path(pattern="done", search_depth=1, sort_by_mdate=True)

    def find_subdirs_contain_path(
        self,
        pattern: str,
        search_depth: int,
        search_root: str | None = None,
        max_count: int | None = None,
        sort_by_mdate: bool = False,
    ) -> list[str]:
        """The directories holding a file that matches ``pattern`` (paths relative to the storage)."""
        files = self.find_files(pattern, search_depth + 1, search_root, max_count, sort_by_mdate)
        return [os.path.dirname(file) for file in files]

    @abstractmethod
    def dir_exists(self, dirname: str) -> bool: ...

    @abstractmethod
    def file_exists(self, filename: str) -> bool: ...

    @abstractmethod
    def find_files(
        self,
        pattern: str,
        search_depth: int,
        search_root: str | None = None,
        max_count: int | None = None,
        sort_by_mdate: bool = False,
    ) -> list[str]: ...

    @abstractmethod
    def save_text(self, text: str, filename: str) -> None: ...

    @abstractmethod
    def save_object(self, obj: object, filename: str) -> None: ...

    @abstractmethod
    def load_object(self, filename: str, map_location: Any = None) -> Any: ...

    @abstractmethod
    def create_dir(self, dirname: str, exist_ok: bool = True) -> None: ...

    @abstractmethod
    def create_shared_dir(
        self, dirname: str, exist_ok: bool = True, process_group: dist.ProcessGroup | None = None
    ) -> None: ...

    @abstractmethod
    def remove_dir(self, dirname: str) -> None: ...

    @abstractmethod
    def remove_file(self, filename: str) -> None: ...

    def remove_dirs(self, dirnames: list[str]) -> None:
        for dirname in dirnames:
            self.remove_dir(dirname)

    def remove_files(self, filenames: list[str]) -> None:
        for filename in filenames:
            if self.file_exists(filename):
                self.remove_file(filename)


class FilesysCheckpointStorage(BaseCheckpointStorage):
    """Checkpoints under a directory of a file system (shared by the ranks that write them)."""

    def _path(self, relative: str) -> Path:
        return Path(self._dirname) / relative

    def dir_exists(self, dirname: str) -> bool:
        return self._path(dirname).is_dir()

    def file_exists(self, filename: str) -> bool:
        return self._path(filename).is_file()

    def find_files(
        self,
        pattern: str,
        search_depth: int,
        search_root: str | None = None,
        max_count: int | None = None,
        sort_by_mdate: bool = False,
    ) -> list[str]:
        """Files matching ``pattern`` at any depth under the storage (or ``search_root`` in it), relative paths;
        oldest first with ``sort_by_mdate``; at most ``max_count``."""
        if not os.path.isdir(self._dirname):
            return []
        base = os.path.join(self._dirname, search_root) if search_root else self._dirname
        paths = glob.glob(os.path.join(base, "**", pattern), recursive=False)
        if sort_by_mdate:
            paths.sort(key=os.path.getmtime)
        if isinstance(max_count, int) and max_count > 0:
            paths = paths[:max_count]
        return [os.path.relpath(path, self._dirname) for path in paths]

    def _atomic(self, filename: str, write: Any) -> None:
        target = self._path(filename)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp{os.getpid()}")
        write(temporary)
        os.replace(temporary, target)

    def save_text(self, text: str, filename: str) -> None:
        self._atomic(filename, lambda path: path.write_text(text))

    def save_object(self, obj: Any, filename: str) -> None:
        self._atomic(filename, lambda path: torch.save(obj, path))

    def load_object(self, filename: str, map_location: Any = None) -> Any:
        return torch.load(self._path(filename), map_location=map_location, weights_only=False)

    def remove_dir(self, dirname: str) -> None:
        shutil.rmtree(self._path(dirname), ignore_errors=True)

    def remove_file(self, filename: str) -> None:
        self._path(filename).unlink(missing_ok=True)

    def create_dir(self, dirname: str, exist_ok: bool = True) -> None:
        self._path(dirname).mkdir(parents=True, exist_ok=exist_ok)

    def create_shared_dir(
        self, dirname: str, exist_ok: bool = True, process_group: dist.ProcessGroup | None = None
    ) -> None:
        """Create ``dirname`` once for a group of ranks (group rank 0 creates it; all return once it exists)."""
        if process_group is None:
            self.create_dir(dirname, exist_ok)
            return
        if dist.get_rank(process_group) == 0:
            self.create_dir(dirname, exist_ok)
        dist.barrier(group=process_group)


class S3CheckpointStorage(BaseCheckpointStorage):
    S3_PATH_PREFIX = "s3://"

    def __new__(cls, dirname: str, crt_config: dict | None = None) -> S3CheckpointStorage:
        raise NotImplementedError(
            f"S3 checkpoint storage ({dirname}) needs boto3 and network access, which meshpar does not bring: save to "
            "a file system path (a mounted bucket works) or copy the checkpoint to S3 after it is complete"
        )


def create_checkpoint_storage(dirname: str) -> BaseCheckpointStorage:
    if dirname.startswith(S3CheckpointStorage.S3_PATH_PREFIX):
        return S3CheckpointStorage(dirname)
    return FilesysCheckpointStorage(dirname)


class wait_decrementing_with_jitter:  # noqa: N801 - NxD's name (a tenacity wait strategy)
    """A retry wait: a random whole number of seconds from 1 to ``max_sleep / attempt`` (rounded up)."""

    def __init__(self, max_sleep: float) -> None:
        self.max_sleep = max_sleep

    def __call__(self, retry_state: Any) -> float:
        return random.randint(1, math.ceil(self.max_sleep / retry_state.attempt_number))


_RETRIED_S3_CODES = ("SlowDown", "RequestTimeout", "InternalError", "Throttling")


def is_slow_down_error(exception: BaseException) -> bool:
    """Whether an S3 error is one worth retrying (throttling, timeouts, S3's internal errors)."""
    message = str(exception)
    if any(f"<Code>{code}</Code>" in message for code in _RETRIED_S3_CODES[:3]):
        return True
    response = getattr(exception, "response", None)
    if isinstance(response, dict):
        error = response.get("Error")
        if error is None:
            return "MaxAttemptsReached" in str(response)
        return error.get("Code") in _RETRIED_S3_CODES
    return False


__all__ = [
    "MB",
    "SHM_PATH",
    "BaseCheckpointStorage",
    "FilesysCheckpointStorage",
    "S3CheckpointStorage",
    "create_checkpoint_storage",
    "is_slow_down_error",
    "wait_decrementing_with_jitter",
]
