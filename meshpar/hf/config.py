"""The configuration of :func:`meshpar.parallelize`: a dict, a dataclass or a JSON file, validated up front."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from meshpar.pipeline.executor import check_pipeline_schedule


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = -1  # -1: the rest of the world
    # experts sharded over ep replicas (carved out of dp x cp, which must be a multiple; tokens routed by all-to-all)
    expert_parallel_size: int = 1
    # Megatron-Core's expert_tensor_parallel_size: None (= tp) splits each ep rank's experts over its tp ranks, whole
    # experts each; 1 keeps all of them on every tp rank, each tp rank running a 1/tp share of the tokens (only ep
    # then needs to divide the number of experts)
    expert_tensor_parallel_size: int | None = None
    # token dropping (Megatron-Core's moe_expert_capacity_factor): each expert takes at most ceil(tokens * k / experts
    # * factor) routes of one forward of one replica's tokens, by routing weight ("probs") or token order ("position")
    expert_capacity_factor: float | None = None
    expert_drop_policy: str = "probs"
    # causal LMs: each sequence split over cp ranks, attention over the whole of it (meshpar.hf.context_parallel) by
    # an all-gather of K/V ("all_gather") or a ring of K/V exchanges ("ring")
    context_parallel_size: int = 1
    context_parallel_implementation: str = "all_gather"
    virtual_pipeline_size: int = 1
    num_microbatches: int | None = None  # None: 1, or pipeline_parallel_size under pp (OSLO's configs omit it)
    auto_partition: bool = False  # pp: balance stages by parameter count, embedding and head included
    # pp: "1f1b" (interleaved when virtual_pipeline_size > 1), "zero_bubble" (ZB-H1: a third of 1F1B's bubble,
    # 1F1B's activation memory; one chunk per rank, no FSDP) or "gpipe" (all forwards, then all backwards: every
    # microbatch's activations at once; needed by the routers' load-balancing loss under pp)
    pipeline_schedule: str = "1f1b"
    sequence_parallel: bool = False
    compile: bool = False
    activation_checkpointing: bool = False
    # dp > 1: all-reduce grad buckets while backward runs. None: on CUDA only (on CPU, gloo's reduction competes with
    # backward for the same cores; benchmarks/README.md, bench_dp.py)
    overlap_grad_reduce: bool | None = None
    fsdp: bool = False  # dp > 1: shard parameters, grads and optimizer state over dp (FSDP2 per layer, then the root)
    seed: int = 1234
    # prove the plan on one sharded block against the dense block (None: for plans not from a meshpar table)
    verify: bool | None = None
    # the model's norms replaced by meshpar's fused ops where proven the same math (meshpar.hf.fused). None: on CUDA
    fused_kernels: bool | None = None

    def __post_init__(self) -> None:
        if self.num_microbatches is None:
            self.num_microbatches = self.pipeline_parallel_size
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "expert_parallel_size",
            "context_parallel_size",
            "virtual_pipeline_size",
            "num_microbatches",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config key {name!r} must be a positive int, got {value!r}")
        if self.data_parallel_size != -1 and (
            not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1
        ):
            raise ValueError(
                f"config key 'data_parallel_size' must be -1 or a positive int, got {self.data_parallel_size!r}"
            )
        if self.virtual_pipeline_size > 1 and self.pipeline_parallel_size == 1:
            raise ValueError("config key 'virtual_pipeline_size' > 1 needs 'pipeline_parallel_size' > 1")
        if self.pipeline_parallel_size > 1 and self.num_microbatches < self.pipeline_parallel_size:
            raise ValueError(
                f"config key 'num_microbatches' ({self.num_microbatches}) must be >= 'pipeline_parallel_size' "
                f"({self.pipeline_parallel_size})"
            )
        if self.overlap_grad_reduce is not None and not isinstance(self.overlap_grad_reduce, bool):
            raise ValueError(
                f"config key 'overlap_grad_reduce' must be true, false or null, got {self.overlap_grad_reduce!r}"
            )
        for name in ("auto_partition", "sequence_parallel", "compile", "activation_checkpointing", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config key {name!r} must be true or false, got {getattr(self, name)!r}")
        for name in ("verify", "fused_kernels"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"config key {name!r} must be true, false or null, got {getattr(self, name)!r}")
        check_pipeline_schedule(self.pipeline_schedule, self.virtual_pipeline_size)
        if self.pipeline_schedule == "zero_bubble" and self.fsdp:
            raise ValueError(
                "config keys 'pipeline_schedule': 'zero_bubble' and 'fsdp' exclude each other: FSDP2 reduces a "
                "module's grads when its input grad is done, before a zero-bubble schedule computes the weight grads"
            )
        factor = self.expert_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0):
            raise ValueError(f"config key 'expert_capacity_factor' must be a positive number or null, got {factor!r}")
        if self.expert_drop_policy not in ("probs", "position"):
            raise ValueError(
                f"config key 'expert_drop_policy' must be 'probs' or 'position', got {self.expert_drop_policy!r}"
            )
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp not in (1, self.tensor_parallel_size):
            raise ValueError(
                f"config key 'expert_tensor_parallel_size' must be 1 (experts whole on every tp rank, the tokens split "
                f"over tp) or the tensor-parallel size {self.tensor_parallel_size} (experts split over tp), got {etp!r}"
            )
        if self.context_parallel_implementation not in ("all_gather", "ring"):
            raise ValueError(
                "config key 'context_parallel_implementation' must be 'all_gather' or 'ring', got "
                f"{self.context_parallel_implementation!r}"
            )
        if self.fsdp and self.overlap_grad_reduce:
            raise ValueError(
                "config keys 'fsdp' and 'overlap_grad_reduce' exclude each other: FSDP2 reduce-scatters the grads "
                "itself, overlapped with backward"
            )


_OSLO_KEYS = {"pipeline_parallel_size", "tensor_parallel_size", "data_parallel_size", "num_microbatches", "enable"}


def load_config(config: ParallelConfig | dict[str, Any] | str | os.PathLike | None) -> ParallelConfig:
    """Accepts meshpar's keys and OSLO's ``{"model_parallelism": {"enable": true, "pipeline_parallel_size": N}}``."""
    if config is None:
        return ParallelConfig()
    if isinstance(config, ParallelConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as handle:
            config = json.load(handle)
    if not isinstance(config, dict):
        raise TypeError(
            f"config must be a dict, a ParallelConfig or a path to a JSON file, got {type(config).__name__}"
        )
    values = dict(config)
    oslo = values.pop("model_parallelism", None)
    if oslo is not None:
        unknown = set(oslo) - _OSLO_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in 'model_parallelism'; allowed: {sorted(_OSLO_KEYS)}")
        if oslo.get("enable", True):
            values.update({k: v for k, v in oslo.items() if k != "enable"})
    allowed = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; allowed keys: {sorted(allowed)}")
    return ParallelConfig(**values)
