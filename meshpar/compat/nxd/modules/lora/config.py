"""``neuronx_distributed.modules.lora.config``: ``LoraConfig``, the settings of a low-rank adapter (LoRA) run.

The fields and defaults are NxD's. ``lora_rank`` ``r`` and ``lora_alpha`` ``a`` give the adapter's scale ``a / r``
(``a / sqrt(r)`` with ``use_rslora``); ``target_modules`` names the layers that get adapters (a list: a module's
full name or the last parts of it; a string: a regular expression the full name must match; ``None``: the table in
:mod:`.model` for the model's ``config.model_type``); ``bias`` says which biases train too (``"none"``, ``"all"``,
``"lora_only"``: those of adapted layers); ``modules_to_save`` names further modules that train and are saved.
The rest steers saving and loading (see :class:`~meshpar.compat.nxd.modules.lora.model.LoraModel`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal


@dataclass
class LoraConfig:
    lora_rank: int = 16
    target_modules: list[str] | str | None = None
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    init_lora_weights: Literal["default", "gaussian"] = "default"
    modules_to_save: list[str] | None = None
    lora_verbose: bool = False
    load_lora_from_ckpt: bool = False
    lora_load_tag: str | None = None
    lora_save_dir: str | None = "lora_adapter"
    merge_lora: bool = False  # a checkpoint with the base holds the adapter merged into the base weights
    save_lora_base: bool = False  # checkpoints hold the base model's weights too
    save_lora_config_adapter: bool = False  # the config travels inside the adapter file, not beside it as JSON
    merge_sharded_lora: bool = True  # adapters saved whole (gathered over tp), not as this rank's shards

    @staticmethod
    def get_selected_fields() -> list[str]:
        """The fields an adapter's saved config records (the rest describe one run, not the adapter)."""
        return [
            "bias",
            "init_lora_weights",
            "lora_alpha",
            "lora_dropout",
            "lora_rank",
            "use_rslora",
            "target_modules",
            "modules_to_save",
            "save_lora_base",
            "merge_lora",
            "save_lora_config_adapter",
        ]

    def selected_fields_to_save(self) -> dict[str, Any]:
        """The recorded fields, plus ``r`` (HF PEFT's name for the rank) so PEFT can read the config."""
        values = asdict(self)
        saved = {key: values[key] for key in self.get_selected_fields()}
        saved["r"] = self.lora_rank
        return saved

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (list, tuple, set)):
            self.target_modules = list(dict.fromkeys(self.target_modules))  # repeats dropped, order kept


__all__ = ["LoraConfig"]
