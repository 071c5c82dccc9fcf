"""Prove a tensor-parallel plan on one transformer block before the model is sharded with it.

A plan that is not one of meshpar's own can be wrong for a model in ways no error shows: an attention that reshapes
with a head count sharding changed reads half the features as half the sequence; a norm between column and row
layers gets each rank's partial grad. So ``parallelize`` runs the first block of each distinct structure twice on
the block's real inputs (captured from a short dense forward): once dense, once sharded with the plan on the tp mesh,
and compares the block's output, its input grad and every parameter grad. On a mismatch every
tp rank raises, naming the submodules whose outputs differ first and the parameters whose grads differ.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshpar._compat import DTensor, local_tensor
from meshpar._shards import in_parameter_layout, local_slice
from meshpar.failure import first_failure_on_any_rank, shared_refusal
from meshpar.hf.hf_plan import embedding_and_head, takes_use_cache, text_config
from meshpar.hf.plans import HFPlan
from meshpar.hf.stages import block_lists
from meshpar.parallel_dims import ParallelDims

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}  # relative norm error; half precision: 2e-2


class PlanVerificationError(ValueError):
    """The sharded block does not compute what the dense block computes."""


class _CapturedError(Exception):  # stops the dense forward at the block
    pass


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _capture_block_inputs(model: nn.Module, block: nn.Module) -> tuple[tuple, dict]:
    """The positional and keyword arguments the model passes its first block, from a dense forward on 2 x 8
    random token ids that stops at the block."""
    captured: dict[str, Any] = {}

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["call"] = (args, kwargs)
        raise _CapturedError

    vocab = getattr(text_config(model.config), "vocab_size", None) or 2
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    # no KV cache: the dense run would fill it, and the sharded block would append its own heads to it
    extra = {"use_cache": False} if takes_use_cache(model) else {}
    device = next(iter(model.parameters())).device
    if getattr(model.config, "is_encoder_decoder", False):  # the decoder's blocks need decoder inputs to be reached
        extra["decoder_input_ids"] = ids.to(device)
    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids.to(device), **extra)
    except _CapturedError:
        pass
    finally:
        handle.remove()
    if "call" not in captured:
        raise PlanVerificationError(f"{type(model).__name__}: its forward never reached the first transformer block")
    return captured["call"]


def _skeleton(layers: str, index: int, block: nn.Module) -> nn.Module:
    """A module tree in which ``block`` sits at ``{layers}.{index}``, so the plan's full-FQN patterns and fix-ups
    apply to it unchanged."""
    root = node = nn.Module()
    *path, last = layers.split(".")
    for part in path:
        child = nn.Module()
        node.add_module(part, child)
        node = child
    node.add_module(last, nn.ModuleList([*(nn.Identity() for _ in range(index)), block]))
    return root


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _run(
    block: nn.Module,
    args: tuple,
    kwargs: dict,
    cotangent_seed: int,
    sequence: tuple[int, int] | None = None,
    split_input: bool = False,
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Outputs of every submodule (by name), the block output and the input grad, after one backward against a
    seeded random cotangent of the whole output. ``sequence`` ``(rank, tp)``: return that rank's sequence shard of
    the output and of the input grad; with ``split_input`` the block itself runs on that shard of its input and
    returns its output shard (a sequence-parallel block: its backward combines every rank's cotangent shard)."""
    outputs: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple, out: Any) -> None:  # returns None: the output stays as it is
            first = _first_tensor(out)  # inside a module run in DTensor (a router on shards): this rank's part
            outputs.setdefault(name, local_tensor(first) if first is not None else None)

        return hook

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(sequence[1], 1)[sequence[0]] if sequence is not None else t

    handles = [module.register_forward_hook(record(name)) for name, module in block.named_modules() if name]
    hidden = args[0].clone().requires_grad_(True)
    try:
        out = _first_tensor(block(mine(hidden) if split_input else hidden, *args[1:], **kwargs))
    finally:
        for handle in handles:
            handle.remove()
    whole = list(out.shape)
    if split_input:
        whole[1] *= sequence[1]
    generator = torch.Generator().manual_seed(cotangent_seed)
    cotangent = torch.randn(whole, generator=generator, dtype=out.dtype).to(out.device)
    if split_input:
        (out * mine(cotangent)).sum().backward()
        return outputs, out.detach(), mine(hidden.grad)
    (out * cotangent).sum().backward()
    return outputs, mine(out.detach()), mine(hidden.grad)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-30) -> float:
    """``|actual - expected| / max(|expected|, floor)``: a grad that is zero in exact arithmetic (a key bias under
    softmax) holds only rounding noise, which is judged against ``floor`` instead of its own norm."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).norm() / expected.norm().clamp_min(floor)).item()


def _structure(block: nn.Module) -> tuple:
    return tuple((name, type(module).__name__) for name, module in block.named_modules())


def _compare_block(
    model: nn.Module, plan: HFPlan, dims: ParallelDims, layers: str, index: int
) -> tuple[list[str], list[str]]:
    """(what differs, submodules whose outputs differ) between block ``index`` of the list ``layers`` dense and
    sharded with the plan, on the inputs the model gives that block."""
    block = model.get_submodule(layers)[index]
    device = dims.device
    with torch.random.fork_rng(devices=[]):
        args, kwargs = _capture_block_inputs(model, block)
        if not args:  # transformers passes hidden_states by keyword in some families
            args, kwargs = (kwargs["hidden_states"],), {k: v for k, v in kwargs.items() if k != "hidden_states"}
        args, kwargs = _to(args, device), _to(kwargs, device)
        dense = copy.deepcopy(block).to(device).eval()
        root = _skeleton(layers, index, copy.deepcopy(block).to(device).eval())
        # under sequence parallelism the first layer's entry into shards is the comparison's own split of the input
        styles = {p: s for p, s in plan.styles.items() if not (plan.sequence_parallel and p == f"{layers}.0")}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Parallelize plan key")
            parallelize_module(root, dims.tp_mesh, styles)
        for fixup in plan.fixups:
            fixup(root, dims.tp)
        sharded = root.get_submodule(layers)[index]
        sequence = (dims.tp_rank, dims.tp) if plan.sequence_parallel else None
        dense_outputs, dense_out, dense_grad = _run(dense, args, kwargs, 1, sequence)
        sharded_outputs, sharded_out, sharded_grad = _run(sharded, args, kwargs, 1, sequence, sequence is not None)
    tolerance = _TOLERANCE.get(dense_out.dtype, 2e-2)
    problems = []
    differing = [
        name
        for name, got in sharded_outputs.items()
        if got is not None
        and (want := dense_outputs.get(name)) is not None
        and got.shape == want.shape
        and _relative_error(got, want) > tolerance
    ]
    if dense_out.shape != sharded_out.shape or _relative_error(sharded_out, dense_out) > tolerance:
        problems.append("the block's output")
    if sharded_grad is None or _relative_error(sharded_grad, dense_grad) > tolerance:
        problems.append("the block's input grad")
    # grads far below the block's largest one are compared against 1% of it (see _relative_error)
    floor = 1e-2 * max((p.grad.norm().item() for p in dense.parameters() if p.grad is not None), default=0.0)
    for name, param in sharded.named_parameters():
        want = dense.get_parameter(name).grad
        got = param.grad
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"grad of {name} (missing on one side)")
            continue
        if isinstance(got, DTensor):
            got, want = got.to_local(), local_slice(in_parameter_layout(want, sharded, name), param)
        if got.shape != want.shape or _relative_error(got, want, max(floor, 1e-30)) > tolerance:
            problems.append(f"grad of {name}")
    return problems, differing


def _compare_embedding(model: nn.Module, plan: HFPlan, dims: ParallelDims) -> list[str]:
    """What differs between the input embedding dense and sharded by the plan, for an ``nn.Embedding`` subclass with
    a forward of its own (a plain one becomes meshpar's tested :class:`ParallelEmbedding`)."""
    name = embedding_and_head(model)[0]
    style = plan.styles.get(name) if name else None
    module = model.get_submodule(name) if style is not None else None
    if module is None or type(module) is nn.Embedding:
        return []
    dense = copy.deepcopy(module).to(dims.device)
    sharded = parallelize_module(copy.deepcopy(module).to(dims.device), dims.tp_mesh, style)
    ids = torch.randint(0, module.num_embeddings, (2, 8), generator=torch.Generator().manual_seed(0))
    outputs = []
    for embedding in (dense, sharded):
        out = embedding(ids.to(dims.device))
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * cotangent.to(out.device)).sum().backward()
        outputs.append(out.detach())
    tolerance = _TOLERANCE.get(outputs[0].dtype, 2e-2)
    problems = [f"the output of {name}"] if _relative_error(outputs[1], outputs[0]) > tolerance else []
    for param_name, param in sharded.named_parameters():
        want, got = dense.get_parameter(param_name).grad, param.grad
        if isinstance(got, DTensor):
            got, want = got.to_local(), local_slice(want, param)
        if _relative_error(got, want) > tolerance:
            problems.append(f"grad of {name}.{param_name}")
    return problems


def _first_failure(
    model: nn.Module, plan: HFPlan, dims: ParallelDims, blocks: list[tuple[str, int]]
) -> tuple[str | None, list[str], list[str]] | None:
    """(the failing block's FQN or None for the embedding, what differs, submodules that differ) for the first
    failing check of ``blocks`` (layer list, index). Never raises: an exception in the model's code on its shards is
    a failure like a mismatch, so every rank reaches the agreeing all-reduce."""
    current = None
    try:
        with torch.random.fork_rng(devices=[]):
            problems = _compare_embedding(model, plan, dims)
        if problems:
            return None, [f"{p} differ(s)" for p in problems], []
        for layers, index in blocks:
            current = f"{layers}.{index}"
            problems, differing = _compare_block(model, plan, dims, layers, index)
            if problems:
                return current, [f"{', '.join(problems[:8])} differ(s)"], differing
    except Exception as error:
        return current, [f"it raises {type(error).__name__}: {error}"], []
    return None


def _without_token_dropping(plan: HFPlan) -> HFPlan:
    """The plan with dropless experts: verification proves the sharding against the stock dense block, which drops
    nothing (dropping itself is meshpar's own code, tested on its own)."""
    styles = dict(plan.styles)
    for pattern, style in styles.items():
        if getattr(style, "capacity_factor", None) is not None:
            styles[pattern] = copy.copy(style)
            styles[pattern].capacity_factor = None
    return dataclasses.replace(plan, styles=styles)


def verify_plan(model: nn.Module, plan: HFPlan, dims: ParallelDims) -> None:
    """Raise :class:`PlanVerificationError` on every tp rank unless, for the first block of each distinct structure
    (models mix dense and mixture-of-experts layers, sliding and global attention), the plan's sharded block equals
    the dense one: outputs, input grad, parameter grads. The model itself is not changed."""
    if not plan.layers:
        raise PlanVerificationError(
            f"{type(model).__name__}: cannot verify the plan, no transformer-layer list was found; pass "
            "'verify': false if you have checked the plan yourself"
        )
    # an encoder-decoder's two stacks both (T5's encoder.block and decoder.block)
    stacks = [plan.layers]
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        stacks += [name for name in block_lists(model) if name != plan.layers]
    firsts: dict[tuple, tuple[str, int]] = {}
    for layers in stacks:
        for index, block in enumerate(model.get_submodule(layers)):
            firsts.setdefault((layers, *_structure(block)), (layers, index))
    failure = _first_failure(model, _without_token_dropping(plan), dims, list(firsts.values()))
    report = None
    if failure is not None:
        where_found, problems, differing = failure
        block = f"block {where_found}" if where_found is not None else "embedding or block"
        where = f"; submodule outputs that differ (first first): {differing[:6]}" if differing else ""
        what = ", ".join(problems[:8])
        report = f"the plan's sharded {block} does not match the dense one at tp={dims.tp}: {what}{where}"
    # every rank of the job raises alike (a replica that finds nothing must not go on alone): the job stays usable
    failed = first_failure_on_any_rank(report)
    if failed is not None:
        rank, found = failed
        raise shared_refusal(
            PlanVerificationError(
                f"{type(model).__name__} (rank {rank}): {found}. The modules named compute with something sharding "
                "changed (a head count, a fused layout): pass plan={...} with styles and fix-ups for them, or use tp=1"
            )
        )
