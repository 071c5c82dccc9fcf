"""``neuronx_distributed.modules.lora.model``: ``LoraModel``, a model with low-rank adapters in its target layers,
only the adapters (and what the config adds) trainable.

``LoraModel(model, config)`` replaces each module ``config.target_modules`` names by the LoRA layer for its type
(:mod:`.layer`, :mod:`.tp_layer`) and freezes everything else. Around an ``NxDPPModel`` the adapters go into this
rank's stages (the names are the model's own FQNs), or, for one traced at its first step, into its model before the
trace. Module calls, attributes and ``generate`` pass through to the
wrapped model.

Saving: ``state_dict()`` is the adapter (``lora_*`` tensors, the biases ``config.bias`` trains, ``modules_to_save``)
or, with ``save_lora_base``, the base model too (``merge_lora``: the adapter merged into the base weights, base names
only). With ``merge_sharded_lora`` (the default) tensor-parallel adapters are gathered over tp into the dense
adapter's shapes, the same on every tp rank, so an adapter trained at tp 2 loads at tp 1, 4, or in one process
(loading cuts a whole adapter to this rank's shard). The adapter's config is written beside it as
``adapter_config.json`` (``save_lora_config_adapter``: inside it, as ``lora_config``), with HF PEFT's ``r``.
``save_lora`` / ``load_lora`` write and read ``adapter_model.pt`` in one process; in a parallel job the adapter goes
through NxD's ``save_checkpoint`` / ``load_checkpoint`` (or ``load_lora_from_ckpt`` with ``lora_load_tag``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar._compat import IncompatibleKeys
from meshpar.compat.nxd.modules.lora.config import LoraConfig
from meshpar.compat.nxd.modules.lora.layer import LoraConv2d, LoraEmbedding, LoraLayer, LoraLinear, _hf_conv1d
from meshpar.compat.nxd.modules.lora.tp_layer import LoraGQAQKVParallelLinear, LoraParallelLinear
from meshpar.compat.nxd.modules.qkv_linear import GQAQKVColumnParallelLinear
from meshpar.compat.nxd.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from meshpar.compat.nxd.parallel_layers.mappings import gather_from_tensor_model_parallel_region_with_dim
from meshpar.compat.nxd.parallel_layers.parallel_state import model_parallel_is_initialized
from meshpar.compat.nxd.utils.logger import get_logger

logger = get_logger()

# model_type -> the layers that get adapters when the config names none (HF PEFT's defaults)
MODELS_TO_LORA_TARGET_MODULES_MAPPING: dict[str, list[str]] = {
    "t5": ["q", "v"],
    "mt5": ["q", "v"],
    "bart": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "bloom": ["query_key_value"],
    "blip-2": ["q", "v", "q_proj", "v_proj"],
    "opt": ["q_proj", "v_proj"],
    "gptj": ["q_proj", "v_proj"],
    "gpt_neox": ["query_key_value"],
    "gpt_neo": ["q_proj", "v_proj"],
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"],
    "deberta-v2": ["query_proj", "value_proj"],
    "deberta": ["in_proj"],
    "layoutlm": ["query", "value"],
    "llama": ["q_proj", "v_proj"],
    "chatglm": ["query_key_value"],
    "gpt_bigcode": ["c_attn"],
    "mpt": ["Wqkv"],
    "RefinedWebModel": ["query_key_value"],
    "RefinedWeb": ["query_key_value"],
    "falcon": ["query_key_value"],
    "btlm": ["c_proj", "c_attn"],
    "codegen": ["qkv_proj"],
    "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "stablelm": ["q_proj", "v_proj"],
    "phi": ["q_proj", "v_proj", "fc1", "fc2"],
    "gemma": ["q_proj", "v_proj"],
}
WEIGHTS_NAME = "adapter_model.pt"
CONFIG_NAME = "adapter_config.json"


def _adapter_file(directory: str, tag: str | None) -> str:
    """Where one process's adapter lives: ``directory[/tag]/adapter_model.pt``."""
    return os.path.join(directory if tag is None else os.path.join(directory, tag), WEIGHTS_NAME)


def _is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# -- tensor-parallel adapters: this rank's shard <-> the dense adapter ------------------------------------------------
def _tp(layer: nn.Module) -> tuple[int, int]:
    mesh = layer.tp_mesh
    return mesh.size(), mesh.get_local_rank()


def _qkv_row_sizes(layer: GQAQKVColumnParallelLinear, name: str) -> list[int]:
    """Row counts of the q / k / v parts of ``weight_qkv`` (one part for ``weight_q`` and the like)."""
    kv = layer.kv_output_size_per_partition
    sizes = {"weight_q": [layer.q_output_size_per_partition], "weight_k": [kv], "weight_v": [kv]}
    return sizes.get(name, [layer.q_output_size_per_partition, kv, kv])


def _dense_qkv(layer: GQAQKVColumnParallelLinear, name: str, local: torch.Tensor) -> torch.Tensor:
    """The dense rows of a grouped q/k/v weight from every rank's shard: q parts concatenated, k / v parts with each
    head's ``kv_size_multiplier`` replicas (laid out as the layer's platform lays them) taken once."""
    tp, _ = _tp(layer)
    gathered = gather_from_tensor_model_parallel_region_with_dim(local.contiguous(), 0)
    per_rank = gathered.split(local.shape[0], dim=0)
    sizes = _qkv_row_sizes(layer, name)
    parts = [rank.split(sizes, dim=0) for rank in per_rank]
    dense = []
    for index in range(len(sizes)):
        is_q = name == "weight_q" or (len(sizes) == 3 and index == 0)
        owners = range(tp) if is_q else layer.kv_owner_ranks()
        dense.append(torch.cat([parts[r][index] for r in owners], dim=0))
    return torch.cat(dense, dim=0)


def _local_qkv(layer: GQAQKVColumnParallelLinear, name: str, dense: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a dense grouped q/k/v weight (the inverse of :func:`_dense_qkv`)."""
    tp, rank = _tp(layer)
    sizes = _qkv_row_sizes(layer, name)
    full_sizes = [
        s * tp if (name == "weight_q" or (len(sizes) == 3 and i == 0)) else s * tp // layer.kv_size_multiplier
        for i, s in enumerate(sizes)
    ]
    parts = dense.split(full_sizes, dim=0)
    local = []
    for index, (part, size) in enumerate(zip(parts, sizes, strict=True)):
        is_q = name == "weight_q" or (len(sizes) == 3 and index == 0)
        block = rank if is_q else layer.kv_block_of(rank)
        local.append(part[block * size : (block + 1) * size])
    return torch.cat(local, dim=0)


class LoraModel(nn.Module):
    """A model with LoRA adapters (see the module docstring); ``config`` the :class:`LoraConfig`."""

    prefix: str = "lora_"
    GQAQKVParallelLinear_lora_type = "LoraGQAQKVParallelLinear"
    ColumnParallelLinear_lora_type = "LoraColumnParallelLinear"
    RowParallelLinear_lora_type = "LoraRowParallelLinear"

    def __init__(self, module: nn.Module, config: LoraConfig) -> None:
        if config is None:
            raise ValueError("LoraModel needs a LoraConfig")
        super().__init__()
        if getattr(module, "grad_syncs", None):
            raise ValueError(
                "LoraModel around a pipeline whose dp grad reduction overlaps backward: its buckets "
                "were fixed before the adapters existed; build the NxDPPModel without "
                "overlap_grad_reduce, or through initialize_parallel_model"
            )
        self.module = module
        self.lora_config = config
        self.is_lora_merged = False
        self.is_config_saved = False
        self.is_generate_optimum = False
        self.is_verbose_enabled = config.lora_verbose
        self.modules_to_save = config.modules_to_save
        self.is_lora_enabled = False
        self.is_optimum_enabled = False
        self.is_checkpoint_loaded = False
        self.is_base_model_loaded = False
        self.lora_module_parallel_types: dict[str, str] = {}
        self.lora_kv_size_multiplier = 1
        self._adapted: dict[str, LoraLayer] = {}  # FQN -> its LoRA layer (not a submodule: already in the model)
        if config.load_lora_from_ckpt:
            self.load_checkpoint(config)
        else:
            self.inject_adapter()
            self.print_model_info()

    # -- calls ------------------------------------------------------------------------------------------------------
    def forward(self, *args: Any, task_ids: Any = None, **kwargs: Any) -> Any:
        """The wrapped model's forward with the adapters applied (a merged adapter is unmerged first)."""
        if self.is_lora_merged:
            self.unmerge_lora()
        return self.module(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.generate(*args, **kwargs)

    # -- which modules, and wrapping them ---------------------------------------------------------------------------
    def _roots(self) -> list[nn.Module]:
        """The modules adapters go into: this rank's pipeline stages, or the model (a pipeline traced at its first
        step: its model, before the trace, as NxD adapts it)."""
        if getattr(self.module, "built", True) is False:
            return [self.module.original_torch_module]
        local = getattr(self.module, "local_modules", None)
        return list(local()) if callable(local) else [self.module]

    def _set_target_modules(self) -> None:
        config = self.lora_config
        if config.target_modules is not None:
            return
        model_config = getattr(self.module, "config", None)
        model_type = str(getattr(model_config, "model_type", "unknown"))
        if model_type not in MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            model_type = model_type.lower()
        if model_type not in MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            raise ValueError(
                f"The base model {model_type} is not supported to set target modules automatically. "
                f"The supported model architectures include {list(MODELS_TO_LORA_TARGET_MODULES_MAPPING)}; "
                "set LoraConfig.target_modules"
            )
        config.target_modules = list(MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type])

    def _check_target_module_exists(self, key: str) -> bool:
        """Whether ``key`` (a module's FQN) is a target: a full-name regex match for a string, else the name itself
        or its last dotted parts."""
        targets = self.lora_config.target_modules
        if not targets:
            return False
        if isinstance(targets, str):
            return re.fullmatch(targets, key) is not None
        return key in targets or any(key.endswith(f".{target}") for target in targets)

    def _get_submodules(self, key: str, root: nn.Module | None = None) -> tuple[nn.Module, nn.Module, str]:
        root = self.module if root is None else root
        parent_name, _, target_name = key.rpartition(".")
        return root.get_submodule(parent_name), root.get_submodule(key), target_name

    @staticmethod
    def _inside_adapter(root: nn.Module, key: str) -> bool:
        """``key`` is a LoRA layer or part of one (a stage sharing modules with another may show it again)."""
        module = root
        for part in key.split(".") if key else []:
            if isinstance(module, LoraLayer):
                return True
            module = getattr(module, part)
        return isinstance(module, LoraLayer)

    def inject_adapter(self) -> None:
        """Wrap every target module in its LoRA layer and leave only the adapters trainable."""
        if self.is_lora_enabled:
            return
        self._set_target_modules()
        found = False
        for root in self._roots():
            for key in [name for name, _ in root.named_modules()]:
                if not self._check_target_module_exists(key) or self._inside_adapter(root, key):
                    continue
                found = True
                parent, target, target_name = self._get_submodules(key, root)
                self._create_and_replace(target, target_name, parent, current_key=key)
        if not found:
            raise ValueError(
                f"Target modules {self.lora_config.target_modules} not found in the base model. "
                "Please check the target modules and try again."
            )
        self._mark_only_adapters_as_trainable()
        self.is_lora_enabled = True

    def _create_and_replace(self, target: nn.Module, target_name: str, parent: nn.Module, current_key: str) -> None:
        if current_key is None:
            raise ValueError("Current Key shouldn't be `None`")
        new_module = self._create_new_module(target, current_key)
        self._replace_module(parent, target_name, new_module, target)
        self._adapted[current_key] = new_module

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        setattr(parent, child_name, new_module)

    def _create_new_module(self, target: nn.Module, current_key: str) -> LoraLayer:
        """The LoRA layer for ``target``'s type (recording the tensor-parallel kind for saving)."""
        config = self.lora_config
        if isinstance(target, nn.Embedding):
            return LoraEmbedding(target, config)
        if isinstance(target, nn.Conv2d):
            return LoraConv2d(target, config)
        if isinstance(target, nn.Linear):
            return LoraLinear(target, config)
        kinds = (
            (ColumnParallelLinear, self.ColumnParallelLinear_lora_type),
            (RowParallelLinear, self.RowParallelLinear_lora_type),
        )
        for cls, kind in kinds:
            if isinstance(target, cls):
                self.lora_module_parallel_types[current_key] = kind
                return LoraParallelLinear(base_layer=target, lora_config=config)
        if isinstance(target, GQAQKVColumnParallelLinear):
            self.lora_module_parallel_types[current_key] = self.GQAQKVParallelLinear_lora_type
            self.lora_kv_size_multiplier = target.kv_size_multiplier
            return LoraGQAQKVParallelLinear(base_layer=target, lora_config=config)
        conv1d = _hf_conv1d()
        if conv1d is not None and isinstance(target, conv1d):
            return LoraLinear(target, config, is_conv_1d_layer=True)
        raise ValueError(
            f"Target module {current_key} ({type(target).__name__}) is not supported. LoRA wraps torch.nn.Linear, "
            "torch.nn.Embedding, torch.nn.Conv2d, transformers' Conv1D, ColumnParallelLinear, RowParallelLinear and "
            "GQAQKVColumnParallelLinear"
        )

    def _named_parameters_everywhere(self) -> Iterator[tuple[str, nn.Parameter]]:
        for root in self._roots():
            yield from root.named_parameters()

    def _mark_only_adapters_as_trainable(self) -> None:
        bias = self.lora_config.bias
        if bias not in ("none", "all", "lora_only"):
            raise NotImplementedError(f"Requested bias: {bias}, is not implemented.")
        for name, param in self._named_parameters_everywhere():
            saved = self.modules_to_save is not None and any(key in name for key in self.modules_to_save)
            param.requires_grad = self.prefix in name or saved or (bias == "all" and "bias" in name)
        if bias == "lora_only":
            for layer in self._adapted.values():
                base_bias = getattr(layer.get_base_layer(), "bias", None)
                if isinstance(base_bias, nn.Parameter):
                    base_bias.requires_grad = True

    # -- merging ----------------------------------------------------------------------------------------------------
    def merge_lora(self) -> None:
        if not self.is_lora_merged:
            for layer in self._lora_layers():
                layer.merge()
            self.is_lora_merged = True

    def unmerge_lora(self) -> None:
        if self.is_lora_merged:
            for layer in self._lora_layers():
                layer.unmerge()
            self.is_lora_merged = False

    def _lora_layers(self) -> list[LoraLayer]:
        seen: dict[int, LoraLayer] = {}
        for root in self._roots():
            for module in root.modules():
                if isinstance(module, LoraLayer):
                    seen.setdefault(id(module), module)
        return list(seen.values())

    def get_base_model(self) -> nn.Module:
        return self.module

    # -- state ------------------------------------------------------------------------------------------------------
    def module_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for root in self._roots():
            state.update(root.state_dict())
        return state

    def _restore_module_name(self, key: str) -> str:
        return key.replace(".base_layer", "")

    def _is_adapter_key(self, key: str, all_keys: Mapping[str, Any]) -> bool:
        """Whether ``key`` is saved with the adapter: a ``lora_`` tensor, a bias ``config.bias`` trains, or part of
        ``modules_to_save``."""
        if self.prefix in key:
            return True
        if self.modules_to_save is not None and any(target in key for target in self.modules_to_save):
            return True
        bias = self.lora_config.bias
        if bias == "all":
            return "bias" in key
        if bias == "lora_only" and key.endswith("bias"):
            owner = key[: -len("bias")]
            return any(other.startswith(owner + self.prefix) for other in all_keys)
        return False

    def _get_lora_adapter_state_dict(self, save_dir: str | None = None) -> dict[str, Any]:
        """What ``state_dict`` saves, as this rank holds it: everything (``save_lora_base``), the base with the
        adapter merged in (and ``merge_lora``), or the adapter."""
        config = self.lora_config
        state = self.module_state_dict()
        if config.save_lora_base and not config.merge_lora:
            result = dict(state)
        elif config.save_lora_base:
            self.merge_lora()  # copies: the adapter is taken out of the weights again once the state is read
            merged = self.module_state_dict()
            result = {self._restore_module_name(k): v.clone() for k, v in merged.items() if self.prefix not in k}
        else:
            result = {k: v for k, v in state.items() if self._is_adapter_key(k, state)}
        if config.save_lora_config_adapter:
            result["lora_config"] = self._get_lora_config_dict()
        elif not self.is_config_saved and _is_main_process():
            self.save_config(save_dir)
        return result

    def _get_lora_config_dict(self) -> dict[str, Any]:
        return self.lora_config.selected_fields_to_save()

    def _save_config_to_json(self, filename: str) -> None:
        if not filename.endswith(".json"):
            logger.warning("%s is not a proper json file name.", filename)
        saved = {k: sorted(v) if isinstance(v, set) else v for k, v in self._get_lora_config_dict().items()}
        Path(filename).write_text(json.dumps(saved, indent=2, sort_keys=True))

    def save_config(self, save_dir: str | None = None) -> None:
        directory = self.lora_config.lora_save_dir if save_dir is None else save_dir
        if not directory:
            raise ValueError("no directory for the LoRA config: set LoraConfig.lora_save_dir")
        os.makedirs(directory, exist_ok=True)
        self._save_config_to_json(os.path.join(directory, CONFIG_NAME))
        self.is_config_saved = True

    @torch.no_grad()
    def merge_sharded_lora_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The tensor-parallel adapters in ``state_dict`` gathered over tp into the dense adapter's shapes (every tp
        rank takes part and gets the same result)."""
        for name, tensor in list(state_dict.items()):
            layer, part = self._adapter_of(name)
            if layer is None:
                continue
            kind = self.lora_module_parallel_types[layer]
            if kind == self.ColumnParallelLinear_lora_type and part == "lora_B":
                state_dict[name] = gather_from_tensor_model_parallel_region_with_dim(tensor.contiguous(), 0)
            elif kind == self.RowParallelLinear_lora_type and part == "lora_A":
                state_dict[name] = gather_from_tensor_model_parallel_region_with_dim(tensor.contiguous(), 1)
            elif kind == self.GQAQKVParallelLinear_lora_type and part == "lora_B":
                lora_b = self._adapted[layer].lora_B
                state_dict[name] = _dense_qkv(lora_b, name.rsplit(".", 1)[-1], tensor)
        return state_dict

    def _adapter_of(self, name: str) -> tuple[str | None, str | None]:
        """``(layer FQN, "lora_A" | "lora_B")`` for a tensor-parallel adapter tensor's name, else ``(None, None)``."""
        layer, sep, rest = name.partition(f".{self.prefix}")
        if not sep or layer not in self.lora_module_parallel_types:
            return None, None
        return layer, self.prefix + rest.split(".", 1)[0]

    def _shard_adapter_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Dense tensor-parallel adapter tensors in ``state`` cut to this rank's shards (tensors already of the
        local shape are kept): the inverse of :meth:`merge_sharded_lora_weights`."""
        local_shapes = {k: v.shape for k, v in self.module_state_dict().items()}
        for name, tensor in list(state.items()):
            layer, part = self._adapter_of(name)
            if layer is None or name not in local_shapes or tensor.shape == local_shapes[name]:
                continue
            kind = self.lora_module_parallel_types[layer]
            module = getattr(self._adapted[layer], part)
            if kind == self.GQAQKVParallelLinear_lora_type:
                state[name] = _local_qkv(module, name.rsplit(".", 1)[-1], tensor)
            else:
                tp, rank = _tp(module)
                dim = 0 if kind == self.ColumnParallelLinear_lora_type else 1
                state[name] = tensor.chunk(tp, dim=dim)[rank]
        return state

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """What a checkpoint of this model holds (see the module docstring)."""
        config = self.lora_config
        if config.merge_sharded_lora and (config.save_lora_base or config.merge_lora):
            config.save_lora_base = config.merge_lora = False
            logger.info(
                "merge_sharded_lora is enabled: save_lora_base and merge_lora are turned off, the merged "
                "LoRA adapter alone is saved"
            )
        state = self._get_lora_adapter_state_dict()
        if config.merge_sharded_lora:
            state = self.merge_sharded_lora_weights(state)
        if self.is_lora_merged:
            self.unmerge_lora()
        if destination is None:
            return state
        destination.update({prefix + key: value for key, value in state.items()})  # called by a parent module
        return destination

    def update_state_dict_keys(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A base model's keys renamed to where the base weights now live (``....base_layer.weight``)."""
        for key in self.module_state_dict():
            if ".base_layer" in key:
                plain = key.replace(".base_layer", "")
                if plain in state_dict:
                    state_dict[key] = state_dict.pop(plain)
        return state_dict

    def _load_into_model(self, state: dict[str, Any], strict: bool) -> IncompatibleKeys:
        state = self._shard_adapter_state(dict(state))
        roots = self._roots()
        if len(roots) == 1 and roots[0] is self.module:
            return self.module.load_state_dict(state, strict=strict)
        missing, used = [], set()
        for root in roots:
            own = {k: v for k, v in state.items() if k in root.state_dict()}
            result = root.load_state_dict(own, strict=False)
            missing += result.missing_keys
            used |= own.keys()
        unexpected = sorted(set(state) - used)
        if strict and (missing or unexpected):
            raise RuntimeError(f"loading the LoRA model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return IncompatibleKeys(missing, unexpected)

    def load_state_dict(
        self, state_dict: Mapping[str, Any] | None = None, strict: bool = False, assign: bool = False
    ) -> IncompatibleKeys | None:
        """Load the base model's state (base names are moved under ``base_layer``) and then, with
        ``load_lora_from_ckpt``, the adapter read at construction. An adapter alone (what ``state_dict`` saves)
        loads into the adapters; ``strict`` then asks that every adapter tensor is in it."""
        config = self.lora_config
        result = None
        if state_dict is not None and (not config.save_lora_base or not self.is_checkpoint_loaded):
            state = {k: v for k, v in state_dict.items() if k != "lora_config"}
            current = self.module_state_dict()
            if self.is_lora_enabled and state and all(self._is_adapter_key(k, current) for k in state):
                result = self._load_into_model(state, strict=False)
                wanted = [k for k in current if self._is_adapter_key(k, current)]
                missing = [k for k in wanted if k not in state]
                if strict and missing:
                    raise RuntimeError(f"the LoRA adapter state lacks {missing[:5]}")
                result = IncompatibleKeys(missing, result.unexpected_keys)
            else:
                if self.is_lora_enabled:
                    state = self.update_state_dict_keys(state)
                result = self._load_into_model(state, strict=strict)
            self.is_base_model_loaded = True
        if config.load_lora_from_ckpt:
            lora_result = self.load_lora_adapter()
            if result is None:
                result = lora_result
            else:
                result.missing_keys.extend(lora_result.missing_keys)
                result.unexpected_keys.extend(lora_result.unexpected_keys)
            if result.missing_keys:
                raise RuntimeError(f"Missing keys when loading state dictionary: {', '.join(result.missing_keys)}")
        return result

    # -- one-process save / load ------------------------------------------------------------------------------------
    def save_lora(self, save_dir: str | None = None, adapter_tag: str | None = None) -> None:
        """Write the adapter as ``save_dir[/adapter_tag]/adapter_model.pt`` (one process only)."""
        if model_parallel_is_initialized():
            raise RuntimeError("Please use nxd.save_checkpoint() to save LoRA adapter with NxDModel.")
        self._save_single_device_lora(save_dir, adapter_tag)

    def _save_single_device_lora(self, save_dir: str | None = None, adapter_tag: str | None = None) -> None:
        directory = self.lora_config.lora_save_dir if save_dir is None else save_dir
        if not directory:
            raise ValueError("no directory for the LoRA adapter: set LoraConfig.lora_save_dir")
        if _is_main_process():
            state = self._get_lora_adapter_state_dict(directory)
            path = _adapter_file(directory, adapter_tag)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
            if self.is_lora_merged:
                self.unmerge_lora()

    def load_checkpoint(self, lora_config: LoraConfig) -> None:
        """Read the adapter (and its config) named by ``lora_config`` (``lora_save_dir``, ``lora_load_tag``) without
        loading it: ``load_state_dict`` / ``load_lora`` do. In a parallel job the adapter is this rank's model file
        of an NxD checkpoint (``save_checkpoint(lora_save_dir, lora_load_tag, model=...)``)."""
        save_dir, tag = lora_config.lora_save_dir, lora_config.lora_load_tag
        if not save_dir:
            raise ValueError("load_lora_from_ckpt needs LoraConfig.lora_save_dir")
        if not model_parallel_is_initialized():
            path = _adapter_file(save_dir, tag)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is not found.")
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        else:
            from meshpar.compat.nxd.trainer.checkpoint import _file, _read

            if tag is None:
                raise ValueError("loading a LoRA adapter from an NxD checkpoint needs LoraConfig.lora_load_tag")
            error, checkpoint = _read(Path(save_dir) / str(tag), _file("model", False))
            if error is not None:
                raise FileNotFoundError(error)
        if "lora_config" in checkpoint:
            self.lora_config = self._load_config_from_ckpt(lora_config, checkpoint)
            checkpoint = {k: v for k, v in checkpoint.items() if k != "lora_config"}
        else:
            filename = os.path.join(save_dir, CONFIG_NAME)
            logger.info("LoRA configuration is not saved in the checkpoint. Try to load it from %s", filename)
            self.lora_config = self._load_config_from_json(lora_config, filename)
        self.modules_to_save = self.lora_config.modules_to_save
        self.lora_ckpt = checkpoint
        self.is_checkpoint_loaded = True

    def _load_config_from_json(self, lora_config: LoraConfig, filename: str) -> LoraConfig:
        if not os.path.isfile(filename):
            raise FileNotFoundError(f"LoRA configuration file {filename} is not found.")
        loaded = json.loads(Path(filename).read_text())
        values = asdict(lora_config)
        values.update({key: loaded[key] for key in lora_config.get_selected_fields()})
        return LoraConfig(**values)

    def _load_config_from_ckpt(self, lora_config: LoraConfig, ckpt: dict[str, Any]) -> LoraConfig:
        saved = ckpt.get("lora_config")
        if saved is None:
            logger.warning("No LoRA configuration is found in checkpoint.")
            return lora_config
        values = asdict(lora_config)
        values.update({key: value for key, value in saved.items() if key in values})
        return LoraConfig(**values)

    def load_lora(
        self,
        save_dir: str | None = None,
        adapter_tag: str | None = None,
        ckpt_path: str | None = None,
        adapter_only: bool = True,
    ) -> IncompatibleKeys:
        """Load the adapter read at construction (one process only); ``adapter_only=False`` first loads the base
        weights from ``ckpt_path`` (default ``save_dir[/adapter_tag]/adapter_model.pt``)."""
        if model_parallel_is_initialized():
            raise RuntimeError("Please use nxd.load_checkpoint() to load LoRA adapter when the base model is NxDModel.")
        return self._load_single_device_lora(save_dir, adapter_tag, ckpt_path, adapter_only)

    def _load_single_device_lora(
        self,
        save_dir: str | None = None,
        adapter_tag: str | None = None,
        ckpt_path: str | None = None,
        adapter_only: bool = True,
    ) -> IncompatibleKeys:
        if not adapter_only:
            if ckpt_path is None:
                ckpt_path = _adapter_file(self.lora_config.lora_save_dir if save_dir is None else save_dir, adapter_tag)
            if not os.path.exists(ckpt_path):
                raise FileNotFoundError(f"The checkpoint file {ckpt_path} is not found.")
            if not self.lora_config.save_lora_base:
                self.module.load_state_dict(torch.load(ckpt_path, map_location="cpu", weights_only=False), strict=False)
        self.is_base_model_loaded = True
        return self.load_lora_adapter()

    def load_lora_adapter(self) -> IncompatibleKeys:
        """Put the adapter read by :meth:`load_checkpoint` into the model (adding the adapters first unless the
        checkpoint holds the base with the adapter merged in)."""
        config = self.lora_config
        if not self.is_checkpoint_loaded:
            raise RuntimeError("no LoRA checkpoint was read: construct with LoraConfig(load_lora_from_ckpt=True)")
        if not self.is_base_model_loaded and not config.save_lora_base:
            raise RuntimeError("load the base model's weights before the adapter (load_state_dict(base_state))")
        if not (config.save_lora_base and config.merge_lora):
            self.inject_adapter()
        result = self._load_into_model(self.lora_ckpt, strict=False)
        self.print_model_info()
        return result

    # -- torch.nn.Module / transformers passthrough -----------------------------------------------------------------
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's parameters under their own names (no ``module.`` prefix)."""
        yield from self.module.named_parameters(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    @property
    def config(self) -> Any:
        return self.module.config

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable, all)`` parameter counts."""
        params = [p for _, p in self.module.named_parameters()]
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        logger.info(
            "trainable params: %s || all params: %s || trainable%%: %s",
            f"{trainable:,d}",
            f"{total:,d}",
            100 * trainable / max(total, 1),
        )

    def print_model_info(self) -> None:
        if self.is_verbose_enabled:
            logger.info("LoRA model: %s", self.module)
            logger.info("LoRA configuration: %s", self.lora_config)
            self.print_trainable_parameters()


__all__ = ["CONFIG_NAME", "MODELS_TO_LORA_TARGET_MODULES_MAPPING", "WEIGHTS_NAME", "LoraModel"]
