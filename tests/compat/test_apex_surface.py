"""Every public name of apex.transformer (enumerated from apex's source into ``apex_surface.txt``) imports from the
same module path under ``meshpar.compat.apex``, except the names listed in :data:`NOT_PROVIDED` with the reason; the
list must stay exact (a name provided later has to leave it). docs/compat.md names the same gaps."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from tests.compat._surface import read_surface

HERE = Path(__file__).resolve().parent
DOCS = HERE.parents[1] / "docs" / "compat.md"

# name -> why meshpar's apex view does not provide it (each one is listed in docs/compat.md)
NOT_PROVIDED: dict[str, str] = {}


def surface() -> dict[str, list[str]]:
    return read_surface(HERE / "apex_surface.txt")


def test_every_apex_name_imports_from_its_apex_path() -> None:
    missing, provided_anyway = [], []
    for module, names in surface().items():
        path = "meshpar.compat.apex" + ("" if module == "." else f".{module}")
        imported = importlib.import_module(path)  # a real module at apex's path, not an attribute
        for name in names:
            key = name if module == "." else f"{module}.{name}"
            present = hasattr(imported, name)
            if not present and key not in NOT_PROVIDED:
                missing.append(f"{path}.{name}")
            if present and key in NOT_PROVIDED:
                provided_anyway.append(key)
    assert not missing, f"apex names meshpar's view lacks: {missing}"
    assert not provided_anyway, f"provided now; take them out of NOT_PROVIDED and docs/compat.md: {provided_anyway}"


def test_the_surface_file_covers_apex_modules() -> None:
    modules = surface()
    for module in ("parallel_state", "tensor_parallel.layers", "tensor_parallel.mappings", "pipeline_parallel.utils",
                   "pipeline_parallel.p2p_communication", "pipeline_parallel.schedules.common", "_data", "amp",
                   "functional", "layers", "microbatches", "enums", "log_util", "utils"):  # fmt: skip
        assert modules.get(module), module
    assert sum(len(names) for names in modules.values()) > 200


def test_docs_name_every_gap() -> None:
    text = DOCS.read_text()
    undocumented = [key for key in NOT_PROVIDED if key.rsplit(".", 1)[-1] not in text]
    assert not undocumented, f"docs/compat.md does not name: {undocumented}"
    assert re.search(r"apex_surface\.txt", text), "docs/compat.md should point to the enumeration it is checked with"
