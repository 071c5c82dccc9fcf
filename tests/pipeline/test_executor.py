"""The pipeline executor on its own: every rank in a thread of one process, point-to-point replaced by in-memory
mailboxes that record what is sent and what is posted. Checks results against the dense model, that each pair of
ranks posts its receives in exactly the order the peer sends (what NCCL, which has no tags, needs), and how many
messages carry a shape header."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from torch import nn

from meshpar.pipeline.executor import PipelineExecutor
from meshpar.pipeline.model import StageChunk
from meshpar.pipeline.schedule_ir import build_actions

HIDDEN = 6


class Mailboxes:
    """Messages in flight between simulated ranks, and the per-pair logs of sends and receive posts."""

    def __init__(self) -> None:
        self.messages: dict[tuple[int, int, int], list[tuple]] = defaultdict(list)
        self.sent: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
        self.posted: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
        self.cond = threading.Condition()

    def take(self, src: int, dst: int, tag: int) -> tuple:
        with self.cond:
            if not self.cond.wait_for(lambda: self.messages[(src, dst, tag)], timeout=600):  # deadlock guard
                raise TimeoutError(f"rank {dst} waits for tag {tag} from rank {src}")
            return self.messages[(src, dst, tag)].pop(0)


class FakeReceive:
    """One message's receive: its tensors' metas known (payload posted) or not (header posted first)."""

    def __init__(self, box: Mailboxes, src: int, dst: int, tag: int, metas: tuple | None) -> None:
        self.box, self.src, self.dst, self.tag, self.metas = box, src, dst, tag, metas
        with box.cond:
            box.posted[(src, dst)].append((tag, "header" if metas is None else "payload"))

    @property
    def has_header(self) -> bool:
        return self.metas is None

    def header_arrived(self) -> bool:
        # under the lock and without creating the key: a defaultdict insert racing the sender's (a GC pause between
        # its lookup and its store lets another thread in) could replace the list the sender appended to
        with self.box.cond:
            return self.has_header and bool(self.box.messages.get((self.src, self.dst, self.tag)))

    def resolve(self) -> None:
        if self.has_header:
            self.metas = self.box.take(self.src, self.dst, self.tag)
            with self.box.cond:
                self.box.posted[(self.src, self.dst)].append((self.tag, "payload"))

    def wait(self) -> tuple[torch.Tensor, ...]:
        self.resolve()
        data = self.box.take(self.src, self.dst, self.tag)
        assert [(tuple(t.shape), t.dtype) for t in data] == list(self.metas), (data, self.metas)
        return tuple(t.clone() for t in data)


class FakeP2P:
    def __init__(self, box: Mailboxes, rank: int, pp: int) -> None:
        self.box, self.rank = box, rank
        self.prev_rank, self.next_rank = (rank - 1) % pp, (rank + 1) % pp

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, tag: int, *, header: bool) -> None:
        with self.box.cond:
            if header:
                self.box.sent[(self.rank, dst)].append((tag, "header"))
                self.box.messages[(self.rank, dst, tag)].append(tuple((tuple(t.shape), t.dtype) for t in tensors))
            self.box.sent[(self.rank, dst)].append((tag, "payload"))
            self.box.messages[(self.rank, dst, tag)].append(tuple(t.detach().clone() for t in tensors))
            self.box.cond.notify_all()

    def post(self, src: int, tag: int, metas: tuple | None = None) -> FakeReceive:
        return FakeReceive(self.box, src, self.rank, tag, metas)

    def wait_all(self) -> None:
        pass


class Layers(nn.Module):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def run_pipeline(
    schedule: str,
    pp: int,
    v: int,
    m: int,
    fixed: bool,
    forward_only: bool = False,
    between: dict | None = None,
    with_loss: bool = True,
    outputs: dict | None = None,
):
    """``between``: each rank's executor gets a ``between_forwards_and_backwards`` hook appending, per call, how
    many microbatches' forwards are awaiting their backward to ``between[rank]``. ``with_loss=False``: the forward
    step gives no loss function. ``outputs``: each rank's executor keeps the last stage's outputs there."""
    torch.manual_seed(0)
    dense = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(pp * v))
    lengths = [3 + i % 2 for i in range(m)]  # microbatches of two sequence lengths unless fixed
    batches = [torch.randn(2, 3 if fixed else n, HIDDEN) for n in lengths]
    box = Mailboxes()
    losses: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    replicas = [nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(pp * v)) for _ in range(pp)]
    for replica in replicas:
        replica.load_state_dict(dense.state_dict())

    def forward_step(x: torch.Tensor, chunk: StageChunk) -> tuple[torch.Tensor, object]:
        return chunk(x=x), (lambda out: out.square().mean()) if with_loss else None

    def rank_main(rank: int) -> None:
        try:
            stages = [rank + k * pp for k in range(v)]
            chunks = [StageChunk(Layers(nn.ModuleList([replicas[rank][s]])), s, ["x"]) for s in stages]
            executor = PipelineExecutor(
                chunks, rank, pp, FakeP2P(box, rank, pp), fixed_shapes=fixed, loss_scale=1.0 / m
            )
            if between is not None:
                calls = between.setdefault(rank, [])
                executor.between_forwards_and_backwards = lambda: calls.append(len(executor.slots))
            executor.keep_outputs = outputs is not None
            losses[rank] = executor.run(build_actions(schedule, pp, v, m), batches, forward_step, forward_only)
            if outputs is not None:
                outputs[rank] = executor.outputs
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(pp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # a deadlocked rank raises from its mailbox wait
    if errors:
        raise errors[0]
    return dense, replicas, batches, losses, box


@pytest.mark.parametrize(
    ("schedule", "pp", "v", "m"),
    [("gpipe", 2, 1, 3), ("1f1b", 2, 1, 4), ("1f1b", 3, 1, 5), ("interleaved_1f1b", 2, 2, 4),
     ("interleaved_1f1b", 2, 2, 5), ("interleaved_1f1b", 3, 2, 7), ("interleaved_1f1b", 4, 3, 6),
     ("zb_h1", 2, 1, 4), ("zb_h1", 3, 1, 5), ("zb_h1", 4, 1, 4),
     # fewer microbatches than stages (NxD's 1F1B takes them; later ranks only idle longer)
     ("1f1b", 4, 1, 2), ("gpipe", 3, 1, 1), ("zb_h1", 3, 1, 2)],
)  # fmt: skip
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "variable"])
def test_executor_matches_dense_and_posts_receives_in_send_order(
    schedule: str, pp: int, v: int, m: int, fixed: bool
) -> None:
    dense, replicas, batches, losses, box = run_pipeline(schedule, pp, v, m, fixed)
    expected = []
    for x in batches:
        for layer in dense:
            x = torch.tanh(layer(x))
        expected.append(x.square().mean())
    (sum(expected) / m).backward()
    last = (pp * v - 1) % pp
    torch.testing.assert_close(torch.stack(losses[last]), torch.stack(expected).detach())
    for rank, replica in enumerate(replicas):  # each rank's own layers got the dense grads
        for stage in range(rank, pp * v, pp):
            for mine, ref in zip(replica[stage].parameters(), dense[stage].parameters(), strict=True):
                torch.testing.assert_close(mine.grad, ref.grad, atol=1e-6, rtol=1e-5)
    assert set(box.sent) == set(box.posted)
    for pair, sent in box.sent.items():
        assert box.posted[pair] == sent, pair  # same messages, same order, on every pair
    headers = sum(kind == "header" for sent in box.sent.values() for kind in [k for _, k in sent])
    activations = (pp * v - 1) * m
    assert headers == (pp * v - 1 if fixed else activations)  # fixed: one per receiving stage per step


def test_the_hook_between_forwards_and_backwards_runs_once_after_every_forward() -> None:
    """GPipe: on every rank after all m forwards (m microbatches awaiting backward) and before any backward; a
    forward-only step calls it after its forwards; a schedule interleaving them is refused."""
    calls: dict[int, list[int]] = {}
    run_pipeline("gpipe", 3, 1, 4, fixed=True, between=calls)
    assert calls == {0: [4], 1: [4], 2: [4]}
    calls.clear()
    run_pipeline("gpipe", 2, 1, 2, fixed=True, forward_only=True, between=calls)
    assert calls == {0: [0], 1: [0]}
    with pytest.raises(ValueError, match="use pipeline schedule 'gpipe'"):
        run_pipeline("1f1b", 2, 1, 3, fixed=True, between={})


def test_forward_only_posts_no_gradient_receives() -> None:
    _, _, _, losses, box = run_pipeline("1f1b", 2, 1, 4, fixed=True, forward_only=True)
    assert len(losses[1]) == 4
    assert all(tag % 2 == 0 for posted in box.posted.values() for tag, _ in posted)  # activations only ("F")


def test_a_forward_only_step_may_have_no_loss() -> None:
    """No loss function: the last stage reports no loss and keeps its outputs, which equal the dense model's; a
    training step without one is refused (there is nothing to differentiate)."""
    outputs: dict = {}
    dense, _, batches, losses, box = run_pipeline("1f1b", 2, 1, 3, True, forward_only=True, with_loss=False,
                                                  outputs=outputs)  # fmt: skip
    assert losses == {0: [], 1: []} and outputs[0] == {}
    assert set(box.sent) == {(0, 1)}  # the last stage sends nothing on
    with torch.no_grad():
        for i, x in enumerate(batches):
            for layer in dense:
                x = torch.tanh(layer(x))
            torch.testing.assert_close(outputs[1][i], x)
    with pytest.raises(ValueError, match="a training step needs a loss"):
        run_pipeline("1f1b", 1, 1, 2, True, with_loss=False)
