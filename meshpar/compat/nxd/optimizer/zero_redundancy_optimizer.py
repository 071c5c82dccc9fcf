"""``neuronx_distributed.optimizer.zero_redundancy_optimizer``: NxD's ZeRO-1 optimizer (torch_xla's
``ZeroRedundancyOptimizer`` arguments) on meshpar's :class:`meshpar.optim.DistributedOptimizer`.

It is handed the raw (not dp-averaged) grads, as NxD's is: ``step`` reduce-scatters them over dp so each rank
receives the averaged grads of the parameters it owns, clips them to ``max_norm`` over the whole model (tp shards,
replicas and pipeline stages counted once each; ``grad_norm`` keeps the norm), steps its share and all-gathers the
updated parameters. Parameter groups keep their own options. Options that tune torch_xla's buckets or its
compiler (``pin_layout``, ``coalesce_cc``, ``bucket_cap_mb_*``, ``use_grad_acc_hook``, ``lazy_init``) change nothing
here; ``optimizer_dtype`` / ``higher_cc_precision`` keep fp32 master copies of low-precision parameters and reduce
in fp32. ``sharding_groups`` must be the data-parallel groups (the default), or at context-parallel size > 1 NxD's
dp x cp groups (``parallel_state.get_zero1_sharding_groups()``, which NxD's trainer passes): the reduce-scatter then
sums the cp ranks' grads too, so ``grads.allreduce_context_parallel_gradients`` only divides them by cp (NxD
all-reduces them over cp first; the numbers are the same, one collective fewer). Under expert parallelism the
parameters marked ``expert_model_parallel`` are owned within the expert-data-parallel groups instead (the dp ranks
holding the same experts), as :class:`NeuronEPZero1Optimizer` does in NxD.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpar.compat.nxd.parallel_layers import parallel_state
from meshpar.failure import first_failure_on_any_rank
from meshpar.optim import DistributedOptimizer
from meshpar.parallel_dims import get_parallel


def _layout() -> dict[str, int]:
    dims = get_parallel()
    return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "ep": dims.ep, **({"cp": dims.cp} if dims.cp > 1 else {})}


def zero1_rank() -> int:
    """This rank's place in its ZeRO-1 sharding group, which names its share's files: its dp rank, and under
    context parallelism its place among the dp x cp ranks (the group NxD shards over at cp > 1,
    ``parallel_state.get_zero1_sharding_groups``)."""
    return get_parallel().grad_mesh.get_local_rank()


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(group, params=list(group["params"])) for group in params]
    return [{"params": params}]


class NeuronZero1Optimizer(torch.optim.Optimizer):
    # its reduce-scatter sums the grads over dp x cp (see the module docstring; read by the cp grad average)
    reduces_over_context_parallel = True

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: Callable[..., torch.optim.Optimizer],
        optimizer_dtype: torch.dtype | None = None,
        grad_clipping: bool = True,
        max_norm: float | None = None,
        pin_layout: bool = True,
        sharding_groups: list[list[int]] | None = None,
        grad_norm_groups: list[list[int]] | None = None,
        lazy_init: bool = False,
        coalesce_cc: bool = False,
        save_master_weights: bool = False,
        use_grad_acc_hook: bool = False,
        higher_cc_precision: bool = False,
        **defaults: Any,
    ) -> None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("initialize_model_parallel need to be called before creating NeuronZero1Optimizer")
        dims = get_parallel()
        if sharding_groups is not None and sorted(map(sorted, sharding_groups)) != sorted(
            map(sorted, parallel_state.get_zero1_sharding_groups())
        ):
            raise NotImplementedError(
                "NeuronZero1Optimizer(sharding_groups=...): meshpar shards optimizer state over the data-parallel "
                "groups (with the context-parallel ranks at cp > 1: parallel_state.get_zero1_sharding_groups()) "
                "only; leave sharding_groups unset"
            )
        groups = _groups(params)
        named = [(f"param_{i}", p) for i, p in enumerate(p for group in groups for p in group["params"])]
        master = optimizer_dtype is not None or higher_cc_precision
        self.zero = DistributedOptimizer(
            named, optimizer_class, zero1=True, reduce_scatter_grads=dims.dp > 1, free_local_grads=False,
            master_weights=master,
            reduce_dtype=torch.float32 if higher_cc_precision else None, dims=dims, param_groups=groups, **defaults,
        )  # fmt: skip
        self.grad_clipping, self.max_norm = grad_clipping, 1.0 if max_norm is None else max_norm
        self.save_master_weights = save_master_weights
        self._grad_norm: torch.Tensor | None = None
        # the groups the caller sees hold the model's parameters (as torch_xla's do); their options (an LR
        # scheduler's lr, say) are copied to the inner optimizer's groups at each step
        inner = self.zero.optimizer.param_groups
        self.param_groups = [{**{k: v for k, v in inner_group.items() if k != "params"}, "params": group["params"]}
                             for group, inner_group in zip(groups, inner, strict=True)]  # fmt: skip

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer stepping this rank's share (torch_xla's name)."""
        return self.zero.optimizer

    def _sync_options(self) -> None:
        for group, inner in zip(self.param_groups, self.zero.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in group.items() if k != "params"})

    @property
    def state(self) -> Any:
        return self.zero.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.zero.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.zero.optimizer.defaults = value

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global grad norm of the last step, before clipping (``None`` before a step or without clipping)."""
        return self._grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_options()
        if self.grad_clipping:
            self._grad_norm = self.zero.clip_grad_norm(self.max_norm).detach().clone()
        self.zero.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._sync_options()  # the groups' options as the caller last set them (a scheduler steps after step())
        return self.zero.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The state and the groups' options (an lr a scheduler set, say), as torch's optimizers load them."""
        self.zero.init_state()
        self.zero.load_state_dict(state_dict)
        for group, inner in zip(self.param_groups, self.zero.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in inner.items() if k != "params"})

    def _shard_file(self, output_dir: str) -> Path:
        dims = get_parallel()
        name = f"zero1_dp_rank_{zero1_rank():02d}_tp_rank_{dims.tp_rank:02d}_pp_rank_{dims.pp_rank:02d}.pt"
        return Path(output_dir) / name

    def save_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Each rank writes its share of the optimizer state (atomically) under ``output_dir``; then a barrier."""
        file = self._shard_file(output_dir)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.tmp")
        torch.save({"layout": _layout(), "state": self.state_dict()}, tmp)
        os.replace(tmp, file)
        dist.barrier()

    def load_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Load what :meth:`save_sharded_state_dict` wrote at this layout (refused on every rank otherwise)."""
        file = self._shard_file(output_dir)
        error, payload = None, None
        if not file.exists():
            error = f"{file} does not exist (saved at another layout?)"
        else:
            payload = torch.load(file, map_location=get_parallel().device, weights_only=False)
            if payload["layout"] != _layout():
                error = f"{file} was saved at {payload['layout']}, this run is {_layout()}"
        failed = first_failure_on_any_rank(error)
        if failed is not None:
            raise ValueError(f"load_sharded_state_dict failed on rank {failed[0]}: {failed[1]}")
        self.load_state_dict(payload["state"])

    def __repr__(self) -> str:
        return f"NeuronZero1Optimizer({self.zero.optimizer!r})"


class NeuronEPZero1Optimizer(NeuronZero1Optimizer):
    """NxD's ZeRO-1 optimizer for models with expert parallelism. :class:`NeuronZero1Optimizer` already owns the
    state of the parameters marked ``expert_model_parallel`` within the expert-data-parallel groups (the dp ranks
    holding the same experts; their grads summed there and divided by dp) and the rest within dp, which is what NxD
    splits into two inner optimizers here; ``sharding_groups`` must be the data-parallel groups, as NxD requires."""


__all__ = ["NeuronEPZero1Optimizer", "NeuronZero1Optimizer"]
