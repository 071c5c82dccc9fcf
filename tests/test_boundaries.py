"""Where things may live: private torch only in meshpar/_compat.py (a torch upgrade touches one file), and the
compatibility views at the edge (no core module imports meshpar.compat), fault injection only in meshpar.testing."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "meshpar"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _private_torch(tree: ast.AST) -> list[str]:
    """Imports from private torch modules and ``torch.<...>._name`` attribute chains (dunders aside)."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                names = [".".join(["torch", *reversed(chain)])]
        for name in names:
            parts = name.split(".")
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                found.append(f"line {node.lineno}: {name}")
    return found


def test_private_torch_is_used_only_in_compat() -> None:
    offenders = {}
    for path in _modules():
        if path.name == "_compat.py" and path.parent == PACKAGE:
            continue
        found = _private_torch(ast.parse(path.read_text()))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"private torch outside meshpar/_compat.py: {offenders}"


def test_the_check_finds_private_torch() -> None:
    code = "import torch\nfrom torch.utils._pytree import tree_map\nx = torch._assert_async\ny = torch.__version__\n"
    assert _private_torch(ast.parse(code)) == [
        "line 2: torch.utils._pytree",
        "line 2: torch.utils._pytree.tree_map",
        "line 3: torch._assert_async",
    ]


def test_no_core_module_imports_the_compat_views() -> None:
    offenders = []
    for path in _modules():
        if (PACKAGE / "compat") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            targets = [module] if module else names
            if any(t and (t == "meshpar.compat" or t.startswith("meshpar.compat.")) for t in targets):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if module == "meshpar" and "compat" in names:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, f"core modules importing meshpar.compat: {offenders}"


def test_fault_injection_lives_in_the_testing_package_only() -> None:
    """Production modules and the examples never kill their own process (crash points are patched in by
    meshpar.testing.faults and tests/_kill_after.py)."""
    offenders = []
    for path in [*_modules(), *sorted((PACKAGE.parent / "examples").rglob("*.py"))]:
        if (PACKAGE / "testing") in path.parents:
            continue
        text = path.read_text()
        if "os.kill(" in text or "SIGKILL" in text or "KILL_AT" in text:
            offenders.append(str(path.relative_to(PACKAGE.parent)))
    assert not offenders, f"fault injection in production code: {offenders}"


# the registry itself, the Megatron-style getters that read it, and the one entry point that sets it up from a config
_MAY_LOOK_UP_THE_MESH = {"parallel_dims.py", "parallel_state.py", "hf/parallelize.py"}


def test_state_is_passed_not_looked_up() -> None:
    """Layers, losses, clipping, dp, optimizers, seeds and data take their mesh or dims as an argument: only the
    compatibility views (whose APIs have none), the registry and the config entry point read the registered mesh."""
    offenders = []
    for path in _modules():
        relative = str(path.relative_to(PACKAGE))
        if (PACKAGE / "compat") in path.parents or (PACKAGE / "testing") in path.parents:
            continue
        if relative in _MAY_LOOK_UP_THE_MESH:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "get_parallel"
            ):
                offenders.append(f"{relative}:{node.lineno}")
    assert not offenders, f"core modules looking up the registered mesh: {offenders}"
