"""Megatron / NxD tensor-parallel layers whose parameters are DTensors on the tp mesh.

Parameters carry their placements (column: weight ``Shard(0)``; row: weight ``Shard(1)``, bias ``Replicate()``;
vocab embedding: ``Shard(0)``), so DCP, FSDP2 and ``torch.compile`` see real DTensors. The forward pass runs on the
local shards with the explicit collectives of :mod:`._collectives`: one all-reduce forward and one backward per
column/row pair (all-gather + reduce-scatter under sequence parallelism), no DTensor dispatch on the hot path.

Activations are plain tensors, batch-first ``[batch, seq, hidden]``; under sequence parallelism they are sequence
shards ``[batch, seq/tp, hidden]`` (the ``Shard(1)`` layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from meshpar._compat import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from meshpar._in_place import become, mix_into
from meshpar.tensor_parallel._collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from meshpar.tensor_parallel._init import (
    InitMethod,
    check_divisible,
    empty_dtensor,
    fill_from_full_,
    linear_bias_init,
    linear_weight_init,
    shard_range,
)
from meshpar.tensor_parallel._linear_functions import (
    ColumnLinearFunction,
    ColumnLinearLocalFunction,
    ColumnLinearSequenceParallelFunction,
    RowLinearFunction,
    RowLinearSequenceParallelFunction,
    matrix,
    vector,
)


def _checked_tp_mesh(tp_mesh: DeviceMesh, owner: str) -> DeviceMesh:
    """The layer's tp mesh, passed explicitly (``dims.tp_mesh``): meshpar's layers look up no process-wide state (the
    apex and NxD views, whose APIs have no mesh argument, pass the one their parallel state holds)."""
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(f"{owner}: tp_mesh must be the tensor-parallel DeviceMesh (dims.tp_mesh), got {tp_mesh!r}")
    return tp_mesh


def _local_input(x: torch.Tensor, owner: str) -> torch.Tensor:
    if isinstance(x, DTensor):
        if all(isinstance(p, (Replicate, Shard)) for p in x.placements):
            return x.to_local()
        raise TypeError(f"{owner} got a DTensor input with placements {x.placements}; pass a local tensor")
    return x


def _local_or_none(param: DTensor | None) -> torch.Tensor | None:
    return param.to_local() if param is not None else None


def _fused_eager_path(sequence_parallel: bool) -> bool:
    """One autograd node per layer in eager mode without sequence parallelism (it also runs at tp=1)."""
    return not sequence_parallel and not torch.compiler.is_compiling()


def _fused_sequence_parallel_path(mesh: DeviceMesh) -> bool:
    """One autograd node per sequence-parallel layer or norm in eager mode when there is a sequence to split (tp > 1);
    under ``torch.compile`` the composed path the compiler traces."""
    return not torch.compiler.is_compiling() and mesh.size() > 1


def _is_meta(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "meta"


def distribute_parameter(
    param: torch.Tensor,
    mesh: DeviceMesh,
    placements: list,
    src_data_rank: int | None = 0,
    *,
    requires_grad: bool | None = None,
) -> nn.Parameter:
    """``param``'s value as an ``nn.Parameter`` holding a DTensor with ``placements`` on ``mesh`` (rank
    ``src_data_rank``'s values; ``None``: each rank's own), trainable as ``param`` is unless ``requires_grad`` says
    otherwise: the one way every tp style and layer turns a dense parameter into a sharded one."""
    tensor = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank)
    return nn.Parameter(tensor, requires_grad=param.requires_grad if requires_grad is None else requires_grad)


def mark_partitioned(module: nn.Module) -> None:
    """NxD / Megatron parameter attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) on
    ``module``'s own parameters, read off their DTensor placements (``Shard(d)``: split along ``d``), for code that
    reads them."""
    for param in module.parameters(recurse=False):
        dims = [p.dim for p in getattr(param, "placements", ()) if isinstance(p, Shard)]
        param.tensor_model_parallel = bool(dims)
        param.partition_dim = dims[0] if dims else -1
        param.partition_stride = 1


def _shard_linear_params_(
    linear: nn.Linear, mesh: DeviceMesh, weight_placement: Shard, bias_placement: Shard | Replicate, src: int | None
) -> None:
    linear.weight = distribute_parameter(linear.weight, mesh, [weight_placement], src)
    if linear.bias is not None:
        linear.bias = distribute_parameter(linear.bias, mesh, [bias_placement], src)


class _TensorParallelLinear(nn.Linear):
    """What column and row layers share: global sizes, the tp mesh and shard-exact initialisation."""

    # the weight is stored [in, out] (HF's Conv1D, see meshpar.hf.conv1d): the same forward and autograd functions
    # run it through a transposed view
    weight_in_out = False

    def _set_sizes(self, mesh: DeviceMesh, input_size: int, output_size: int, init_method: InitMethod | None) -> None:
        self.tp_mesh = mesh
        self.in_features = self.input_size = input_size
        self.out_features = self.output_size = output_size
        self.init_method = init_method

    def reset_parameters(self) -> None:
        """Dense ``nn.Linear`` init by default; with ``init_method``, that for the weight and zeros for the bias."""
        if self.init_method is None:
            fill_from_full_(self.weight, linear_weight_init)
            if self.bias is not None:
                fill_from_full_(self.bias, linear_bias_init(self.input_size))
        else:
            fill_from_full_(self.weight, self.init_method)
            if self.bias is not None:
                fill_from_full_(self.bias, torch.nn.init.zeros_)


class ColumnParallelLinear(_TensorParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by output features (weight ``Shard(0)``).

    Input: replicated ``[..., in]`` (or a sequence shard ``[b, s/tp, in]`` with ``sequence_parallel_enabled``).
    Output: this rank's ``[..., out/tp]`` slice, or the full ``[..., out]`` with ``gather_output=True``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        sequence_parallel_enabled: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        init_method: InitMethod | None = None,
        tp_mesh: DeviceMesh,
        num_heads: int | None = None,
        allow_uneven: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        mesh = _checked_tp_mesh(tp_mesh, type(self).__name__)
        if num_heads is not None:
            check_divisible(num_heads, mesh.size(), "the number of attention heads", type(self).__name__)
        if not allow_uneven:
            check_divisible(output_size, mesh.size(), "output_size", type(self).__name__)
        self._configure(mesh, input_size, output_size, gather_output, sequence_parallel_enabled, init_method)
        self.weight = empty_dtensor((output_size, input_size), mesh, [Shard(0)], dtype=dtype, device=device)
        self.bias = empty_dtensor((output_size,), mesh, [Shard(0)], dtype=dtype, device=device) if bias else None
        if not _is_meta(device):
            self.reset_parameters()
        mark_partitioned(self)

    def _configure(
        self,
        mesh: DeviceMesh,
        input_size: int,
        output_size: int,
        gather_output: bool,
        sequence_parallel_enabled: bool,
        init_method: InitMethod | None,
    ) -> None:
        self._set_sizes(mesh, input_size, output_size, init_method)
        self.gather_output = gather_output
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.input_gathered = False
        self.regather_input = False

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        tp_mesh: DeviceMesh,
        *,
        gather_output: bool = False,
        sequence_parallel_enabled: bool = False,
        src_data_rank: int | None = 0,
        num_heads: int | None = None,
        allow_uneven: bool = False,
        input_gathered: bool = False,
        regather_input: bool = False,
    ) -> ColumnParallelLinear:
        """Shard an existing ``nn.Linear`` in place (the module object is kept; its class becomes this one).

        ``num_heads`` (for q/k/v or fused QKV projections) checks that every rank gets whole heads.
        ``regather_input`` (sequence parallel): save the input's sequence shard, not the gathered input, and
        all-gather it again in backward (Megatron's memory-saving choice; one more all-gather per layer input).
        """
        if num_heads is not None:
            check_divisible(num_heads, tp_mesh.size(), "the number of attention heads", cls.__name__)
        if not allow_uneven:
            check_divisible(linear.out_features, tp_mesh.size(), "out_features", cls.__name__)
        _shard_linear_params_(linear, tp_mesh, Shard(0), Shard(0), src_data_rank)
        become(linear, cls)
        linear._configure(
            tp_mesh, linear.in_features, linear.out_features, gather_output, sequence_parallel_enabled, None
        )
        linear.input_gathered = input_gathered
        linear.regather_input = regather_input
        mark_partitioned(linear)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _local_input(x, type(self).__name__)
        if self.sequence_parallel_enabled and _fused_sequence_parallel_path(self.tp_mesh):
            y = ColumnLinearSequenceParallelFunction.apply(
                x, self.weight, self.bias, self.tp_mesh, self.regather_input, self.weight_in_out
            )
        elif self.sequence_parallel_enabled:
            y = F.linear(gather_from_sp(x, self.tp_mesh, 1), *self._local_params())
        elif self.input_gathered:  # a module-level gather already owns the input-grad reduction
            y = F.linear(x, *self._local_params())
        elif torch.compiler.is_compiling():
            y = ColumnLinearLocalFunction.apply(x, *self._local_params(), self.tp_mesh)
        elif getattr(self, "shared_input_group", None) is not None:  # q/k/v, gate/up: one input-grad all-reduce
            y = self.shared_input_group.output_for(self, x)
        else:
            y = ColumnLinearFunction.apply(x, self.weight, self.bias, self.tp_mesh, self.weight_in_out)
        return self._maybe_gather(y)

    def _local_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The local weight and bias as ``F.linear`` takes them (differentiable views of the DTensors)."""
        return matrix(self.weight.to_local(), self.weight_in_out), vector(_local_or_none(self.bias))

    def _maybe_gather(self, y: torch.Tensor) -> torch.Tensor:
        if not self.gather_output:
            return y
        chunk = -(-self.output_size // self.tp_mesh.size())
        if chunk * self.tp_mesh.size() == self.output_size:
            return gather_from_tp(y, self.tp_mesh, dim=-1)
        # uneven shards (a vocab tp does not divide): pad to equal chunks, gather, drop the padding
        padded = F.pad(y, (0, chunk - y.shape[-1]))
        return gather_from_tp(padded, self.tp_mesh, dim=-1)[..., : self.output_size]

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size} (tp={self.tp_mesh.size()}), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel_enabled}"
        )


class RowParallelLinear(_TensorParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by input features (weight ``Shard(1)``, bias ``Replicate()``).

    Input: this rank's ``[..., in/tp]`` slice (``input_is_parallel=True``) or the full ``[..., in]``, which is then
    split locally. Output: the full ``[..., out]`` (all-reduced), or the sequence shard ``[b, s/tp, out]``
    (reduce-scattered) with ``sequence_parallel_enabled``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel_enabled: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | bool | None = False,
        *,
        init_method: InitMethod | None = None,
        tp_mesh: DeviceMesh,
    ) -> None:
        nn.Module.__init__(self)
        device = None if device is False else device  # NxD documents device=False: the default device
        mesh = _checked_tp_mesh(tp_mesh, type(self).__name__)
        check_divisible(input_size, mesh.size(), "input_size", type(self).__name__)
        self._configure(mesh, input_size, output_size, input_is_parallel, sequence_parallel_enabled, init_method)
        self.weight = empty_dtensor((output_size, input_size), mesh, [Shard(1)], dtype=dtype, device=device)
        self.bias = empty_dtensor((output_size,), mesh, [Replicate()], dtype=dtype, device=device) if bias else None
        if not _is_meta(device):
            self.reset_parameters()
        mark_partitioned(self)

    def _configure(
        self,
        mesh: DeviceMesh,
        input_size: int,
        output_size: int,
        input_is_parallel: bool,
        sequence_parallel_enabled: bool,
        init_method: InitMethod | None,
    ) -> None:
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel_enabled=True requires input_is_parallel=True")
        self._set_sizes(mesh, input_size, output_size, init_method)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel_enabled = sequence_parallel_enabled

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        tp_mesh: DeviceMesh,
        *,
        input_is_parallel: bool = True,
        sequence_parallel_enabled: bool = False,
        src_data_rank: int | None = 0,
    ) -> RowParallelLinear:
        """Shard an existing ``nn.Linear`` in place (the module object is kept; its class becomes this one)."""
        check_divisible(linear.in_features, tp_mesh.size(), "in_features", cls.__name__)
        _shard_linear_params_(linear, tp_mesh, Shard(1), Replicate(), src_data_rank)
        become(linear, cls)
        linear._configure(
            tp_mesh, linear.in_features, linear.out_features, input_is_parallel, sequence_parallel_enabled, None
        )
        mark_partitioned(linear)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _local_input(x, type(self).__name__)
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_mesh, dim=-1)
        if _fused_eager_path(self.sequence_parallel_enabled):
            return RowLinearFunction.apply(x, self.weight, self.bias, self.tp_mesh, self.weight_in_out)
        if self.sequence_parallel_enabled and _fused_sequence_parallel_path(self.tp_mesh):
            return RowLinearSequenceParallelFunction.apply(x, self.weight, self.bias, self.tp_mesh, self.weight_in_out)
        weight = matrix(self.weight.to_local(), self.weight_in_out)
        if self.sequence_parallel_enabled:
            y = reduce_scatter_to_sp(F.linear(x, weight), self.tp_mesh, dim=-2)
        else:
            y = reduce_from_tp(F.linear(x, weight), self.tp_mesh)
        if self.bias is None:
            return y
        bias = self.bias.to_local()
        if self.sequence_parallel_enabled:
            # Each rank adds the bias to its own sequence shard: its grad is a partial sum over tp ranks.
            bias = copy_to_tp(bias, self.tp_mesh)
        return y + bias

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size} (tp={self.tp_mesh.size()}), out={self.output_size}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel_enabled}"
        )


class ParallelEmbedding(nn.Embedding):
    """Embedding sharded over the vocabulary (weight ``Shard(0)``) or, with ``shard_across_embedding``, over the
    embedding dim (weight ``Shard(1)``).

    Vocab sharding: each rank looks up the ids it owns, zeroes the rest and the partial results are all-reduced
    (reduce-scattered over the sequence with ``sequence_parallel_enabled``). Output ``[..., embedding_dim]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: InitMethod | None = torch.nn.init.normal_,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        padding_idx: int | None = None,
        shard_across_embedding: bool = False,
        sequence_parallel_enabled: bool = False,
        tp_mesh: DeviceMesh,
    ) -> None:
        nn.Module.__init__(self)
        mesh = _checked_tp_mesh(tp_mesh, type(self).__name__)
        if shard_across_embedding:
            check_divisible(embedding_dim, mesh.size(), "embedding_dim", type(self).__name__)
        self._configure(
            mesh,
            num_embeddings,
            embedding_dim,
            padding_idx,
            shard_across_embedding,
            sequence_parallel_enabled,
            init_method,
        )
        placement = Shard(1) if shard_across_embedding else Shard(0)
        self.weight = empty_dtensor((num_embeddings, embedding_dim), mesh, [placement], dtype=dtype, device=device)
        if not _is_meta(device):
            self.reset_parameters()
        mark_partitioned(self)

    def _configure(
        self,
        mesh: DeviceMesh,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None,
        shard_across_embedding: bool,
        sequence_parallel_enabled: bool,
        init_method: InitMethod | None,
    ) -> None:
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.tp_mesh = mesh
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.shard_across_embedding = shard_across_embedding
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.init_method = init_method
        self.max_norm = None
        self.sparse = False
        # a vocab tp does not divide is split like torch.chunk: the last rank holds fewer rows (no padding rows)
        start, length = (0, num_embeddings) if shard_across_embedding else shard_range(num_embeddings, mesh)
        self.vocab_start_index, self.vocab_end_index = start, start + length

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        tp_mesh: DeviceMesh,
        *,
        shard_across_embedding: bool = False,
        sequence_parallel_enabled: bool = False,
        src_data_rank: int | None = 0,
    ) -> ParallelEmbedding:
        """Shard an existing ``nn.Embedding`` in place."""
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("ParallelEmbedding does not support max_norm or sparse embeddings")
        if shard_across_embedding:
            check_divisible(embedding.embedding_dim, tp_mesh.size(), "embedding_dim", cls.__name__)
        placement = Shard(1) if shard_across_embedding else Shard(0)
        embedding.weight = distribute_parameter(embedding.weight, tp_mesh, [placement], src_data_rank)
        become(embedding, cls)
        embedding._configure(
            tp_mesh,
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            shard_across_embedding,
            sequence_parallel_enabled,
            None,
        )
        mark_partitioned(embedding)
        return embedding

    def reset_parameters(self) -> None:
        def init(full: torch.Tensor) -> None:
            (self.init_method or torch.nn.init.normal_)(full)
            if self.padding_idx is not None:
                full[self.padding_idx].zero_()

        fill_from_full_(self.weight, init)

    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is None or not self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return None
        return self.padding_idx - self.vocab_start_index

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local()
        if self.shard_across_embedding:
            out = gather_from_tp(F.embedding(ids, weight, self.padding_idx), self.tp_mesh, dim=-1)
            return scatter_to_sp(out, self.tp_mesh, dim=1) if self.sequence_parallel_enabled else out
        if self.tp_mesh.size() == 1:
            out = F.embedding(ids, weight, self.padding_idx)
            return out
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, weight, self._local_padding_idx())
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel_enabled:
            return reduce_scatter_to_sp(out, self.tp_mesh, dim=1)
        return reduce_from_tp(out, self.tp_mesh)

    def extra_repr(self) -> str:
        how = "embedding dim" if self.shard_across_embedding else "vocab"
        return f"{self.num_embeddings}, {self.embedding_dim}, sharded over {how} (tp={self.tp_mesh.size()})"


VocabParallelEmbedding = ParallelEmbedding


@contextlib.contextmanager
def parameters_replaced(module: nn.Module, replacements: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run the module's own forward on other tensors in place of some of its parameters (their local shards),
    restoring the parameters afterwards whatever happens.

    Only for forwards DTensor cannot run on the sharded parameters themselves (a sequence-parallel norm does not
    need it: :func:`make_sequence_parallel_norm`): an experts module indexes its ``Shard(0)`` expert weights by
    expert id, which DTensor answers by gathering every expert onto every rank; a vocab-sharded embedding subclass's
    lookup in DTensor computes the weight's grad as a replicated full-vocabulary tensor on every rank."""
    params = module._parameters
    saved = {name: params[name] for name in replacements}
    try:
        params.update(replacements)
        yield
    finally:
        params.update(saved)


def _replicate_partial_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a ``Replicate()`` parameter used on rank-local rows: DTensor leaves its grad a
    ``Partial`` sum of the ranks' rows; all-reduce it into the parameter's own placement as soon as it is accumulated,
    so everything reading grads after backward (clipping, dp sync, optimizers) sees the dense grad. Under FSDP2 the
    parameter objects are FSDP's, which does the same redistribution itself."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _rows_as_dtensor(mesh: DeviceMesh, owner: str) -> tuple[object, object]:
    """The pre- and post-hook that run a row-wise module (a norm, a router) on DTensors: its first tensor argument is
    this rank's rows of one ``Shard(0)`` DTensor (its sequence shard, or its heads), and so is every other argument
    of the same rank and number of rows; other tensors (a bias handed in) are replicated. The module's own forward
    then meets its ``Replicate()`` parameters and buffers in DTensor and computes with them unchanged; the outputs go
    back to local rows. A DTensor first argument (a vocab-parallel lookup's rows) is left as it is, and so is the
    output."""
    entered: list[bool] = []

    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        if not tensors or isinstance(tensors[0], DTensor):
            entered.append(False)
            return args, kwargs
        rows = tensors[0]
        if rows.dim() < 2:
            raise ValueError(
                f"{owner}: a module with sequence-parallel or grad-summed parameters runs row-wise on activations "
                f"of at least 2 dims, got one of shape {tuple(rows.shape)}"
            )

        def convert(x: object) -> object:
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() == 0:
                return x
            same_rows = x.dim() == rows.dim() and x.shape[0] == rows.shape[0]
            return DTensor.from_local(x, mesh, [Shard(0)] if same_rows else [Replicate()], run_check=False)

        entered.append(True)
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    def leave(_module: nn.Module, _args: tuple, _kwargs: dict, out: object) -> object:
        if not entered or not entered.pop():  # nothing entered (the pre-hook refused) or the input was a DTensor
            return out

        def local(x: object) -> object:
            if not isinstance(x, DTensor):
                return x
            if tuple(x.placements) != (Shard(0),):
                raise RuntimeError(
                    f"{owner}: its output is {x.placements}, not the rows it was given: the module is not row-wise "
                    "and cannot run on sequence shards"
                )
            return x.to_local()

        if isinstance(out, (tuple, list)):
            return type(out)(local(o) for o in out)
        return local(out)

    return enter, leave


def make_sequence_parallel_norm(module: nn.Module, tp_mesh: DeviceMesh, *, src_data_rank: int | None = 0) -> nn.Module:
    """Make ``module`` (a norm, or any module that works row by row) run on this rank's rows of its input: its own
    parameters and buffers become ``Replicate()`` DTensors and its unchanged forward runs on DTensors (hooks convert
    input and output, the parameters are never swapped); their grads, partial sums over the ranks' rows, are
    all-reduced as each is accumulated. Class, parameter names and forward stay the module's own."""
    if getattr(module, "_meshpar_row_mesh", None) is not None:
        raise ValueError(f"{type(module).__name__} is already sequence parallel")
    owner = type(module).__name__
    # its submodules' plain parameters and buffers too (a router's score-correction bias in a child module): its
    # forward meets them in DTensor; what a submodule's own style already sharded is a DTensor and stays as it is
    for owner_module in module.modules():
        for name, param in list(owner_module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            replicated = distribute_parameter(param, tp_mesh, [Replicate()], src_data_rank)
            if replicated.requires_grad:
                replicated.register_post_accumulate_grad_hook(_replicate_partial_grad)
            setattr(owner_module, name, replicated)
        for name, buffer in list(owner_module.named_buffers(recurse=False)):
            if buffer is not None and not isinstance(buffer, DTensor):
                owner_module._buffers[name] = distribute_tensor(
                    buffer, tp_mesh, [Replicate()], src_data_rank=src_data_rank
                )
    enter, leave = _rows_as_dtensor(tp_mesh, owner)
    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)
    module._meshpar_row_mesh = tp_mesh
    return module


class _VocabParallelLookup:
    """Mixin for an ``nn.Embedding`` subclass with its own forward (Gemma's scaled word embedding), sharded over the
    vocabulary without replacing that forward: each rank runs it on the ids it owns (the others read row 0 of its
    shard), zeroes the tokens it does not own and the partial results are all-reduced. Exact for any forward whose
    output for a token depends only on that token's row (scaling, casting), which is what such subclasses do."""

    tp_mesh: DeviceMesh
    vocab_start_index: int
    vocab_end_index: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        saved_padding = self.padding_idx
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        try:
            self.padding_idx = ParallelEmbedding._local_padding_idx(self)
            with parameters_replaced(self, {"weight": self._parameters["weight"].to_local()}):
                out = super().forward(local_ids)  # type: ignore[misc]
        finally:
            self.padding_idx = saved_padding
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_mesh)


def make_vocab_parallel_subclass(
    embedding: nn.Embedding, tp_mesh: DeviceMesh, *, src_data_rank: int | None = 0
) -> nn.Module:
    """Shard an ``nn.Embedding`` subclass over the vocabulary in place, keeping its own forward (see
    :class:`_VocabParallelLookup`); a plain ``nn.Embedding`` becomes :class:`ParallelEmbedding` instead."""
    cls = type(embedding)
    if embedding.max_norm is not None or embedding.sparse:
        raise ValueError(f"{cls.__name__}: vocab parallelism does not support max_norm or sparse embeddings")
    extra = [name for name, _ in embedding.named_parameters(recurse=False) if name != "weight"]
    if extra:
        raise ValueError(f"{cls.__name__}: vocab parallelism cannot shard an embedding with parameters {extra}")
    # submodules with parameters (a norm over the looked-up rows) see only this rank's tokens: their grads are
    # partial over tp and are summed in backward
    for child in embedding.children():
        if any(True for _ in child.parameters()):
            make_sequence_parallel_norm(child, tp_mesh, src_data_rank=src_data_rank)
    embedding.weight = distribute_parameter(embedding.weight, tp_mesh, [Shard(0)], src_data_rank)
    mix_into(embedding, _VocabParallelLookup, "VocabParallel")
    if embedding.padding_idx is not None and embedding.padding_idx < 0:
        embedding.padding_idx += embedding.num_embeddings
    embedding.tp_mesh = tp_mesh
    start, length = shard_range(embedding.num_embeddings, tp_mesh)
    embedding.vocab_start_index, embedding.vocab_end_index = start, start + length
    return embedding


class ReplicatedKVLinear(nn.Linear):
    """Key or value projection of grouped-query attention when there are fewer KV heads than tp ranks.

    The weight stays whole (``Replicate()``); each rank computes all KV heads and keeps the one its query heads
    attend with (head ``tp_rank * num_kv_heads // tp``), so each KV head is replicated ``tp / num_kv_heads`` times.
    Input and weight go through ``copy_to_tp``: every rank's grads are partial (only its own query heads used the
    head), and their sum over tp is the dense grad.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_mesh: DeviceMesh, *, num_kv_heads: int) -> ReplicatedKVLinear:
        tp = tp_mesh.size()
        if tp % num_kv_heads != 0:
            raise ValueError(f"{num_kv_heads} key/value heads cannot be replicated evenly over tp={tp}")
        _shard_linear_params_(linear, tp_mesh, Replicate(), Replicate(), 0)
        become(linear, cls)
        linear.tp_mesh, linear.num_kv_heads = tp_mesh, num_kv_heads
        linear.head_dim = linear.out_features // num_kv_heads
        linear.kv_head = tp_mesh.get_local_rank() * num_kv_heads // tp
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(_local_input(x, type(self).__name__), self.tp_mesh)
        rows = slice(self.kv_head * self.head_dim, (self.kv_head + 1) * self.head_dim)
        weight = copy_to_tp(self.weight.to_local(), self.tp_mesh)[rows]
        bias = copy_to_tp(self.bias.to_local(), self.tp_mesh)[rows] if self.bias is not None else None
        return F.linear(x, weight, bias)
