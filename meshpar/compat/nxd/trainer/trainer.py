"""``neuronx_distributed.trainer.trainer``: NxD's config and its model / optimizer initialisation.

``neuronx_distributed_config(...)`` fills NxD's defaults and (in a distributed job) sets up the parallel state;
``initialize_parallel_model(config, model_fn, ...)`` builds the model (on ``meta`` with ``meta_device_init``),
wraps it in ``NxDPPModel`` at pp > 1 (``pipeline_config`` holds its arguments), moves it to the process's device,
adds LoRA adapters (``lora_config``: a ``LoraModel`` around it, :mod:`meshpar.compat.nxd.modules.lora`), pads it,
applies activation checkpointing and returns an ``NxDModel``; ``initialize_parallel_optimizer`` builds the
optimizer (ZeRO-1 with ``optimizer_config["zero_one_enabled"]``) and returns an ``NxDOptimizer``. Mixed-precision
settings ``use_master_weights`` / ``use_fp32_grad_acc`` keep fp32 master copies / reduce in fp32 in the ZeRO-1
optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpar.compat.nxd import xla
from meshpar.compat.nxd.modules.lora import LoraModel
from meshpar.compat.nxd.optimizer import NeuronZero1Optimizer
from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.compat.nxd.parallel_layers.pad import pad_model as _pad_model
from meshpar.compat.nxd.pipeline.model import NxDPPModel
from meshpar.compat.nxd.trainer.model import NxDModel
from meshpar.compat.nxd.trainer.optimizer import NxDOptimizer
from meshpar.compat.nxd.utils.activation_checkpoint import apply_activation_checkpointing
from meshpar.compat.nxd.utils.logger import get_logger
from meshpar.compat.nxd.utils.model_utils import (
    get_model_sequential,
    init_on_device,
    is_hf_pretrained_model,
)

logger = get_logger()


def _fill(config: dict[str, Any], key: str, value: Any) -> None:
    if key not in config:
        if parallel_state.is_global_rank_zero():
            logger.log(logging.WARNING, "%s is not set, automatically set it to %s.", key, value)
        config[key] = value


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_config: dict[str, Any] | None = None,
    optimizer_config: dict[str, Any] | None = None,
    activation_checkpoint_config: Any = None,
    pad_model: bool = False,
    sequence_parallel: bool = False,
    model_init_config: dict[str, Any] | None = None,
    lora_config: Any = None,
    mixed_precision_config: dict[str, Any] | None = None,
    sequential_move_factor: int = 11,
    lnc_size: int = 1,
) -> dict[str, Any]:
    """NxD's training config with its defaults filled in; sets up the parallel state when torch.distributed is."""
    if optimizer_config is None:
        optimizer_config = {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0}
    elif not isinstance(optimizer_config, dict):
        raise TypeError("optimizer_config must be a dict")
    _fill(optimizer_config, "zero_one_enabled", False)
    _fill(optimizer_config, "grad_clipping", True)
    if optimizer_config["grad_clipping"]:
        _fill(optimizer_config, "max_grad_norm", 1.0)
    zero1 = optimizer_config["zero_one_enabled"]
    if mixed_precision_config is None:
        mixed_precision_config = {"use_master_weights": zero1, "use_fp32_grad_acc": zero1,
                                  "use_master_weights_in_ckpt": False}  # fmt: skip
    elif not isinstance(mixed_precision_config, dict):
        raise TypeError("mixed_precision_config must be a dict")
    _fill(mixed_precision_config, "use_master_weights", zero1)
    _fill(mixed_precision_config, "use_fp32_grad_acc", zero1)
    _fill(mixed_precision_config, "use_master_weights_in_ckpt", False)
    if model_init_config is None:
        model_init_config = {"sequential_move_factor": sequential_move_factor, "meta_device_init": False,
                             "param_init_fn": None}  # fmt: skip
    elif not isinstance(model_init_config, dict):
        raise TypeError("model_init_config must be a dict")
    _fill(model_init_config, "sequential_move_factor", sequential_move_factor)
    _fill(model_init_config, "meta_device_init", False)
    if model_init_config["meta_device_init"] and "param_init_fn" not in model_init_config:
        raise ValueError("param_init_fn must be provided when meta_device_init is True")
    config = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "expert_parallel_size": expert_parallel_size,
        "context_parallel_size": context_parallel_size,
        "pipeline_config": pipeline_config,
        "optimizer_config": optimizer_config,
        "activation_checkpoint_config": activation_checkpoint_config,
        "pad_model": pad_model,
        "sequence_parallel": sequence_parallel,
        "model_init_config": model_init_config,
        "lora_config": lora_config,
        "mixed_precision_config": mixed_precision_config,
        "lnc_size": lnc_size,
    }
    if dist.is_initialized():
        _initialize_state(config)
    return config


def _initialize_state(config: dict[str, Any]) -> None:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config["tensor_parallel_size"],
        pipeline_model_parallel_size=config["pipeline_parallel_size"],
        context_parallel_size=config["context_parallel_size"],
        expert_model_parallel_size=config["expert_parallel_size"],
        lnc_size=config["lnc_size"],
    )


def _checkpointed_classes(config: dict[str, Any], model: nn.Module, base_model: nn.Module) -> tuple[type, ...]:
    choice = config["activation_checkpoint_config"]
    if isinstance(model, LoraModel):
        model = model.get_base_model()
    if choice == "full":
        if isinstance(model, NxDPPModel):
            return (model.transformer_layer_cls,)
        if is_hf_pretrained_model(base_model):
            names = set(getattr(base_model, "_no_split_modules", None) or ())
            return tuple({type(m) for m in base_model.modules() if type(m).__name__ in names})
        raise RuntimeError('activation_checkpoint_config "full" is only supported for HuggingFace models or at pp > 1')
    classes = tuple(choice) if isinstance(choice, (list, tuple)) else (choice,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"activation_checkpoint_config must be 'full' or module classes, got {choice!r}")
    return classes


def initialize_parallel_model(
    nxd_config: dict[str, Any],
    model_fn: Callable[..., nn.Module],
    include_buffers: bool = False,
    *model_args: Any,
    **model_kwargs: Any,
) -> NxDModel:
    """``model_fn(*model_args, **model_kwargs)`` made parallel as ``nxd_config`` says; returns an ``NxDModel``."""
    if not parallel_state.model_parallel_is_initialized():
        _initialize_state(nxd_config)
    init = nxd_config["model_init_config"]
    param_init_fn = init.get("param_init_fn")
    if init["meta_device_init"]:
        with init_on_device(torch.device("meta"), include_buffers=include_buffers):
            model = model_fn(*model_args, **model_kwargs)
    else:
        model = model_fn(*model_args, **model_kwargs)
    base_model = model
    pipelined = nxd_config["pipeline_parallel_size"] > 1
    if pipelined:
        pipeline_config = dict(nxd_config["pipeline_config"] or {})
        pipeline_config.update(param_init_fn=param_init_fn, use_model_wrapper=True)
        model = NxDPPModel(model, **pipeline_config)
    model = get_model_sequential(model, xla.xla_device(), init["sequential_move_factor"], param_init_fn)
    if nxd_config.get("lora_config") is not None:
        model = LoraModel(model, nxd_config["lora_config"])
    if nxd_config["pad_model"]:
        if not is_hf_pretrained_model(base_model):
            raise ValueError("pad_model=True is supported for HuggingFace models only (as in NxD)")
        model = _pad_model(
            model, parallel_state.get_tensor_model_parallel_size(), base_model.config.num_attention_heads
        )
    nxd_model = NxDModel(model, nxd_config)
    if nxd_config["activation_checkpoint_config"] is not None:
        classes = _checkpointed_classes(nxd_config, model, base_model)
        apply_activation_checkpointing(nxd_model, check_fn=lambda m: isinstance(m, classes))
    return nxd_model


def initialize_optimizer_from_class(
    nxd_config: dict[str, Any],
    optimizer_class: Callable[..., torch.optim.Optimizer],
    parameters: Any,
    model: nn.Module | None = None,
    **defaults: Any,
) -> torch.optim.Optimizer:
    optimizer_config = nxd_config["optimizer_config"]
    precision = nxd_config["mixed_precision_config"]
    defaults.pop("decoupled_weight_decay", None) if optimizer_config["zero_one_enabled"] else None
    if optimizer_config["zero_one_enabled"]:
        return NeuronZero1Optimizer(
            parameters, optimizer_class, optimizer_dtype=torch.float32 if precision["use_master_weights"] else None,
            grad_clipping=optimizer_config["grad_clipping"], max_norm=optimizer_config.get("max_grad_norm"),
            higher_cc_precision=precision["use_fp32_grad_acc"],
            save_master_weights=precision["use_master_weights_in_ckpt"], **defaults,
        )  # fmt: skip
    if precision["use_master_weights"]:
        raise RuntimeError("ZeRO-1 optimizer is not enabled, while `use_master_weights` is True.")
    if precision["use_fp32_grad_acc"] or precision["use_master_weights_in_ckpt"]:
        raise RuntimeError("Non Zero-1 optimizer does not support `use_fp32_grad_acc` of `use_master_weights_in_ckpt`.")
    return optimizer_class(parameters, **defaults)


def initialize_parallel_optimizer(
    nxd_config: dict[str, Any], optimizer_class: Callable[..., torch.optim.Optimizer], parameters: Any, **defaults: Any
) -> NxDOptimizer:
    """The optimizer for ``parameters`` (a model's parameters or param groups) wrapped in ``NxDOptimizer``."""
    config = _with_defaults(nxd_config)
    return NxDOptimizer(initialize_optimizer_from_class(config, optimizer_class, parameters, **defaults), config)


def _with_defaults(nxd_config: dict[str, Any]) -> dict[str, Any]:
    """An empty config (NxD's tests pass ``{}``) reads as the defaults, without touching the parallel state."""
    if "optimizer_config" in nxd_config:
        return nxd_config
    defaults = {"optimizer_config": {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0},
                "mixed_precision_config": {"use_master_weights": False, "use_fp32_grad_acc": False,
                                           "use_master_weights_in_ckpt": False},
                "sequence_parallel": False, "pipeline_parallel_size": 1}  # fmt: skip
    nxd_config.update({key: value for key, value in defaults.items() if key not in nxd_config})
    return nxd_config


def filter_to_local_parameter_group(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Keep in each param group only the parameters this rank's stages hold."""
    local = {id(p) for p in getattr(model, "local_parameters", model.parameters)()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in local]


__all__ = [
    "filter_to_local_parameter_group",
    "initialize_optimizer_from_class",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "neuronx_distributed_config",
]
