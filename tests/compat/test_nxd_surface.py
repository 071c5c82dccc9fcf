"""Every public name of NxD's training surface (enumerated from NxD's source into ``nxd_surface.txt``) imports from
the same module path under ``meshpar.compat.nxd`` (each path a real module), except the modules and names listed
below with the reason; the lists must stay exact (a name provided later has to leave them). docs/compat.md names
the same gaps."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from tests.compat._surface import read_surface

HERE = Path(__file__).resolve().parent
DOCS = HERE.parents[1] / "docs" / "compat.md"

_INFERENCE = "Neuron inference compilation (model tracing to HLO), not training"
# whole modules meshpar's NxD view does not provide -> why (each one is named in docs/compat.md)
MODULES_NOT_PROVIDED: dict[str, str] = {
    "lightning": "NxD's PyTorch Lightning strategy, accelerator and plugins subclass Lightning's XLA ones; "
    "Lightning is not among meshpar's packages, and its XLA strategy is torch_xla's",
}
# single names meshpar's NxD view does not provide -> why (each one is named in docs/compat.md)
NOT_PROVIDED: dict[str, str] = {
    **{
        name: _INFERENCE
        for name in (
            "BaseNxDModel",
            "ModelBuilder",
            "NxDModel",
            "NxDParallelState",
            "TorchScriptNxDModel",
            "convert_nxd_model_to_torchscript_model",
            "shard_checkpoint",
        )
    },
    "parallel_layers.layers.SPMDRank": _INFERENCE,
    "parallel_layers.mappings.scatter_to_process_group_spmd": _INFERENCE,
    "parallel_layers.mappings.round_robin_scatter_to_process_group_spmd": _INFERENCE,
    **{
        f"parallel_layers.parallel_state.{name}": _INFERENCE  # speculative decoding's draft-model groups
        for name in (
            "get_speculative_draft_group",
            "get_speculative_draft_replica_groups",
            "initialize_speculative_draft_group",
        )
    },
    **{
        f"parallel_layers.parallel_state.{name}": "setters that rewrite NxD's global sizes; meshpar's state is one mesh"
        for name in (
            "set_aot_mode",
            "set_context_model_parallel_size",
            "set_expert_model_parallel_rank",
            "set_expert_model_parallel_size",
            "set_tensor_model_parallel_rank",
            "set_tensor_model_parallel_size",
        )
    },
    "optimizer.zero_dcp_utils.MAX_RETRY": "NxD's rank-0 polling for the other ranks' write results (DCP's "
    "collective here)",
}


def surface() -> dict[str, list[str]]:
    return read_surface(HERE / "nxd_surface.txt")


def test_every_nxd_name_imports_from_its_nxd_path() -> None:
    missing, provided_anyway = [], []
    for module, names in surface().items():
        path = "meshpar.compat.nxd" + ("" if module == "." else f".{module}")
        if module in MODULES_NOT_PROVIDED:
            try:
                importlib.import_module(path)
            except ModuleNotFoundError:
                continue
            provided_anyway.append(module)
            continue
        imported = importlib.import_module(path)  # a real module at NxD's path, not an attribute
        assert imported.__name__ == path
        for name in names:
            key = name if module == "." else f"{module}.{name}"
            present = hasattr(imported, name)
            if not present and key not in NOT_PROVIDED:
                missing.append(f"{path}.{name}")
            if present and key in NOT_PROVIDED:
                provided_anyway.append(key)
    assert not missing, f"NxD names meshpar's view lacks: {missing}"
    assert not provided_anyway, f"provided now; take them out of the lists and docs/compat.md: {provided_anyway}"


def test_the_surface_file_covers_nxd_training_modules() -> None:
    modules = surface()
    for module in ("parallel_layers.layers", "parallel_layers.parallel_state", "parallel_layers.mappings",
                   "parallel_layers.grads", "pipeline.model", "trainer.trainer", "trainer.checkpoint", "optimizer",
                   "modules.qkv_linear", "utils.model_utils", "overrides.transformer_overrides"):  # fmt: skip
        assert modules.get(module), module
    assert sum(len(names) for names in modules.values()) > 300


def test_docs_name_every_gap() -> None:
    text = DOCS.read_text()
    keys = [*MODULES_NOT_PROVIDED, *NOT_PROVIDED]
    undocumented = [key for key in keys if key.rsplit(".", 1)[-1] not in text]
    assert not undocumented, f"docs/compat.md does not name: {undocumented}"
    assert re.search(r"nxd_surface\.txt", text), "docs/compat.md should point to the enumeration it is checked with"
