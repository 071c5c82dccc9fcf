"""``neuronx_distributed.utils.model_utils``: moving, re-initialising and materialising a model without losing its
tied weights or NxD's parameter attributes, ``init_on_device`` and the availability probes NxD's trainer asks.

``has_fake_tensors`` / ``maybe_materalize_model`` answer for torchdistX's deferred init, which meshpar does not use
(build on ``meta`` and let ``param_init_fn`` or ``initialize_parallel_model`` materialise the model instead): no
parameter is ever fake here. ``get_platform_lnc`` is the Neuron logical-core count: 1 (one device per process).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import Any

import torch
from torch import nn

# get_local_world_size lives in NxD's model_utils namespace too (its unit tests patch it there)
from meshpar.compat.nxd.parallel_layers.utils import get_local_world_size, set_tensor_model_parallel_attributes  # noqa: F401
from meshpar.data import move_model_to_device as _move_model_to_device

_PARALLEL_ATTRIBUTES = ("expert_model_parallel", "sequence_parallel_enabled", "shared")


class LogicalNCConfig(IntEnum):
    LNC_1 = 1
    LNC_2 = 2


def get_platform_lnc() -> LogicalNCConfig:
    return LogicalNCConfig.LNC_1


def analyze_shared_parameters(
    module: nn.Module, shared_parameters: dict[nn.Parameter, list[str]] | None = None, prefix: str = ""
) -> list[list[str]]:
    """The FQNs of each parameter held under more than one name (tied weights), one list per parameter."""
    names: dict[nn.Parameter, list[str]] = shared_parameters if shared_parameters is not None else {}
    for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return [found for found in names.values() if len(found) > 1]


def _parent(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (module.get_submodule(parent) if parent else module), name


def retie_shared_weights(module: nn.Module, shared_weight_names: list[list[str]]) -> None:
    """Make every name in each list hold the parameter of its first name again."""
    for names in shared_weight_names:
        holder, attribute = _parent(module, names[0])
        reference = getattr(holder, attribute)
        for path in names[1:]:
            target, target_attribute = _parent(module, path)
            setattr(target, target_attribute, reference)


def is_hf_transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def is_hf_accelerate_available() -> bool:
    return importlib.util.find_spec("accelerate") is not None


def is_hf_pretrained_model(model: nn.Module) -> bool:
    if not is_hf_transformers_available():
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def is_nxdt_available() -> bool:
    return False


def is_nxdt_pretrained_model(model: nn.Module) -> bool:
    return False


def recursive_filter(item: Any, predicate: Callable[[Any], bool]) -> Any:
    """The tensors of a nest of lists, tuples and dicts for which ``predicate`` holds, in the same structure
    (non-tensor leaves are kept; a tensor that fails the predicate and an emptied container become ``None`` or
    drop out of their container)."""
    if isinstance(item, (list, tuple)):
        kept = [recursive_filter(value, predicate) for value in item]
        return type(item)(value for value in kept if value is not None)
    if isinstance(item, dict):
        kept_dict = {key: recursive_filter(value, predicate) for key, value in item.items()}
        return {key: value for key, value in kept_dict.items() if value is not None}
    if isinstance(item, torch.Tensor):
        return item if predicate(item) else None
    return item


@contextmanager
def preserve_shared_weights(model: nn.Module, ignore_hf: bool = False) -> Iterator[None]:
    """Re-tie the model's tied weights on exit (an HF model through its own ``tie_weights``)."""
    hf = is_hf_pretrained_model(model) and not ignore_hf
    shared = [] if hf else analyze_shared_parameters(model)
    try:
        yield
    finally:
        if hf:
            model.tie_weights()
        else:
            retie_shared_weights(model, shared)


@contextmanager
def preserve_parallel_attributes(model: nn.Module) -> Iterator[None]:
    """Give parameters replaced inside the block NxD's attributes (tp, expert, sequence-parallel, shared) back."""
    saved: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        attributes = {key: getattr(param, key) for key in _PARALLEL_ATTRIBUTES if hasattr(param, key)}
        if hasattr(param, "tensor_model_parallel"):
            attributes["tp"] = (param.tensor_model_parallel, param.partition_dim, param.partition_stride,
                                getattr(param, "num_partitions", -1))  # fmt: skip
        saved[name] = attributes
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            for key, value in saved.get(name, {}).items():
                if key == "tp":
                    if not hasattr(param, "tensor_model_parallel"):
                        set_tensor_model_parallel_attributes(param, *value)
                elif not hasattr(param, key):
                    setattr(param, key, value)


def move_model_to_device(model: nn.Module, device: torch.device | str) -> None:
    """The model moved to ``device`` with its tied weights and parallel attributes kept."""
    with preserve_parallel_attributes(model), preserve_shared_weights(model):
        _move_model_to_device(model, device)


def reinit_model(
    model: nn.Module, device: torch.device, param_init_fn: Callable[[nn.Module, torch.device], Any]
) -> None:
    """Every parameter replaced by an uninitialised one on ``device``, then ``param_init_fn(module, device)`` for
    each module (its own parameters), ties and attributes kept."""
    with preserve_parallel_attributes(model), preserve_shared_weights(model), torch.no_grad():
        for module in model.modules():
            for key, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[key] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
            param_init_fn(module, device)


def has_fake_tensors(model: nn.Module, ignored_params: set[nn.Parameter] | None = None) -> bool:
    return False


def maybe_materalize_model(model: nn.Module) -> None:
    return None


@contextmanager
def init_on_device(
    device: torch.device | str, include_buffers: bool = False, force_custom_init_on_device: bool = False
) -> Iterator[None]:
    """Modules built inside the block get their parameters (and, with ``include_buffers``, their buffers) on
    ``device`` (``meta``: shapes only)."""
    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            moved = type(param)(param.to(device), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_device  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def get_model_sequential(model: nn.Module, device: torch.device | str, sequential_move_factor: int = 11,
                         param_init_fn: Callable[..., Any] | None = None) -> nn.Module:  # fmt: skip
    """The model on ``device``, as NxD's trainer places it: a pipeline's stages are already built on their device;
    any other model is first re-initialised on CPU by ``param_init_fn(module, device)`` when one is given (a model
    built on meta gets its values that way), then moved. (NxD moves ranks in groups of ``sequential_move_factor`` to
    bound host memory; each process here holds only its own shards and moves at once.)"""
    from meshpar.pipeline.model import PipelineModel

    if isinstance(model, PipelineModel):
        return model
    if param_init_fn is not None:
        reinit_model(model, torch.device("cpu"), param_init_fn)
    elif any(p.is_meta for p in model.parameters()):
        raise ValueError("the model was built on meta: give model_init_config a param_init_fn(module, device)")
    move_model_to_device(model, device)
    return model


def get_delay_tracing(arg: Any) -> bool:
    """Whether pipeline tracing waits for the first batch (NxD's ``_delay_tracing`` in its config)."""
    return bool(arg.get("_delay_tracing", False)) if isinstance(arg, dict) else False


def check_delay_tracing(nxd_config: dict[str, Any]) -> bool:
    pipeline = nxd_config.get("pipeline_config") or {}
    return nxd_config.get("pipeline_parallel_size", 1) > 1 and get_delay_tracing(pipeline)


__all__ = [
    "LogicalNCConfig",
    "analyze_shared_parameters",
    "check_delay_tracing",
    "get_delay_tracing",
    "get_model_sequential",
    "get_platform_lnc",
    "has_fake_tensors",
    "init_on_device",
    "is_hf_accelerate_available",
    "is_hf_pretrained_model",
    "is_hf_transformers_available",
    "is_nxdt_available",
    "is_nxdt_pretrained_model",
    "maybe_materalize_model",
    "move_model_to_device",
    "preserve_parallel_attributes",
    "preserve_shared_weights",
    "recursive_filter",
    "reinit_model",
    "retie_shared_weights",
]
