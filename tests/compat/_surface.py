"""Reading a library's enumerated public surface (``apex_surface.txt``, ``nxd_surface.txt``): one module per line,
``module: names``; ``#`` lines are comments."""

from __future__ import annotations

from pathlib import Path


def read_surface(path: Path) -> dict[str, list[str]]:
    modules = {}
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        module, names = line.split(":", 1)
        modules[module.strip()] = names.split()
    return modules
