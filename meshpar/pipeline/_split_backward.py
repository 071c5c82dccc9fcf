"""A stage's backward in two passes: input grad now, weight grads later (zero-bubble schedules' ``I`` and ``W``).

The input-grad pass runs autograd from the stage's output to its input only. Autograd then skips every branch that
leads to parameters alone (a matmul's weight grad, a norm's scale grad) but still runs the nodes where such a branch
meets the input's path ("frontier" nodes: the matmul itself). A pre-hook on each frontier node records the grads
arriving there. The weight pass restarts autograd from those nodes with the recorded grads and runs towards the
parameters only, so nothing of the input path is computed twice; grads accumulate through the parameters' own
accumulators, so post-accumulate hooks (overlapped dp grad sync) fire as in a full backward.

Parameters are grouped by the frontier nodes they hang off, and each group is one autograd call: a call from a node
upstream would otherwise also run the input path down to another group's frontier. Where one group has frontier
nodes on top of each other (a parameter used twice), a pre-hook pins each to its recorded grads so nothing is counted
twice; the calls keep the graph, since that one walks the input path between them, through other groups' frontier
nodes (each node's saved tensors are freed with the stage's output once the weight pass is done).

meshpar's fused tensor-parallel linears (:mod:`meshpar.tensor_parallel._linear_functions`) ask autograd which of
their grads the current pass needs (:func:`meshpar._compat.grad_needed`), so the input pass skips their weight grad
and the weight pass their input grad and its all-reduce. Other custom autograd functions compute both each time: the
numbers are right, the work is done twice.

A stage whose input needs no grad (the first) has nothing to split: its ``I`` only keeps the output grad and ``W``
runs the whole backward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from meshpar._compat import run_backward_unchecked


def _grad_node(tensor: torch.Tensor) -> Node | None:
    """The autograd node a grad of ``tensor`` flows into: its ``grad_fn``, or a leaf's accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # the leaf's accumulator, which the graph holds


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """For every node reachable from ``root``: the nodes that pass grads into it (the graph's reverse edges)."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    queue, seen = deque([root]), {root}
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _upstream(start: Node, consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], dict[Node, None]]:
    """Nodes from which ``start`` is reachable (``start`` included), not walking through ``stop``; and the nodes of
    ``stop`` met on the way, in the order met (the same on every rank, unlike a set's)."""
    reached, met, queue = {start}, {}, deque([start])
    while queue:
        for parent in consumers.get(queue.popleft(), ()):
            if parent in stop:
                met[parent] = None
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


@dataclass
class _Group:
    params: list[torch.Tensor]
    frontier: dict[Node, None]  # an ordered set
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class DeferredWeightGrads:
    """What an input-grad pass leaves for the weight pass (see the module docstring)."""

    groups: list[_Group]
    whole: tuple[torch.Tensor, torch.Tensor] | None = None  # (output, its grad): the first stage's full backward

    def run(self) -> None:
        if self.whole is not None:
            run_backward_unchecked(*self.whole)
        for group in self.groups:
            _weight_pass(group)
        self.groups, self.whole = [], None


def _replace_with(kept: tuple[torch.Tensor | None, ...] | None) -> Callable[[tuple], tuple | None]:
    return lambda _: kept


def _weight_pass(group: _Group) -> None:
    edges, grads = [], []
    for node in group.frontier:
        for index, grad in enumerate(group.grads.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                grads.append(grad)
    if not edges:  # nothing reached these parameters (e.g. a branch multiplied by a constant zero grad)
        return
    pins = []
    if len(group.frontier) > 1:
        pins = [node.register_prehook(_replace_with(group.grads.get(node))) for node in group.frontier]
    try:
        # the graph is kept: stacked frontier nodes (a parameter used twice along the input path: Gemma-3n's altup
        # router) make autograd walk the input path between them again, through other groups' frontier nodes; it is
        # freed with the stage's output once the last group ran
        torch.autograd.backward(edges, grad_tensors=grads, inputs=group.params, retain_graph=True)
    finally:
        for pin in pins:
            pin.remove()


def backward_input(
    output: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor | None, params: Iterable[torch.Tensor]
) -> DeferredWeightGrads:
    """Accumulate ``stage_input.grad`` from ``output`` (seeded with ``grad``; ``None`` for a scalar loss) and return
    what computes the parameters' grads later."""
    seed = grad if grad is not None else torch.ones_like(output)
    root = output.grad_fn
    input_node = _grad_node(stage_input) if stage_input is not None else None
    consumers = _consumers(root) if root is not None else {}
    if root is None or input_node is None or (input_node not in consumers and input_node is not root):
        return DeferredWeightGrads([], whole=(output, seed))
    input_path, _ = _upstream(input_node, consumers, set())
    by_frontier: dict[Node, _Group] = {}
    for param in params:
        node = _grad_node(param)
        if node is None or node not in consumers:
            continue  # unused by this stage's forward
        _, frontier = _upstream(node, consumers, input_path)
        group = _Group([param], frontier)
        for other in {id(g): g for g in map(by_frontier.get, frontier) if g is not None}.values():
            group.params += other.params  # parameters hanging off a shared frontier node go in one call
            group.frontier |= other.frontier
        by_frontier.update(dict.fromkeys(group.frontier, group))
    groups = list({id(g): g for g in by_frontier.values()}.values())
    hooks = [
        node.register_prehook(lambda grads, node=node, group=group: group.grads.__setitem__(node, tuple(grads)))
        for group in groups
        for node in group.frontier
    ]
    try:
        run_backward_unchecked(output, seed, inputs=(stage_input,), keep_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    return DeferredWeightGrads(groups)
