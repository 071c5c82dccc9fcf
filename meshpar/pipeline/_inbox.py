"""What a pipeline rank receives from each neighbour in one step, posted ahead of use in the neighbour's send order.

Every rank knows every rank's action list, so it knows which messages each neighbour sends it and in which order
(an ``F`` of a stage sends its activation to the next stage, a ``B`` or ``I`` its input grad to the previous one).
Receives are posted in exactly that order: gloo would also match them by tag, but NCCL has no tags and pairs a peer's
sends with the receives in the order they were posted, so a receive posted out of order would take another message's
bytes. Posting ahead lets a transfer overlap the receiver's compute instead of starting when the data is needed.

A receive can be posted once its size is known: a grad's once its forward ran (the shape of the activation the
receiver itself sent); an activation's once its stage's first activation of the step has arrived with a header,
when the step has fixed shapes; otherwise every activation brings a header, and nothing from that peer is posted
after a header until it has arrived and the payload's receive is posted behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from meshpar.pipeline._p2p import P2P, Meta, Receive, message_tag
from meshpar.pipeline.schedule_ir import SENDS_GRAD, Action

Key = tuple[str, int, int]  # ("F": activation into stage | "B": grad into stage, stage, microbatch)
Metas = tuple[Meta, ...]  # a message's tensors' shapes and dtypes


def messages_from(
    peer_actions: Sequence[Action], receiver: int, pp: int, num_stages: int, forward_only: bool
) -> list[Key]:
    """The messages pipeline rank ``receiver`` gets from the rank running ``peer_actions``, in sending order."""
    messages: list[Key] = []
    for action in peer_actions:
        if action.kind == "F" and action.stage < num_stages - 1 and (action.stage + 1) % pp == receiver:
            messages.append(("F", action.stage + 1, action.microbatch))
        elif (
            action.kind in SENDS_GRAD and not forward_only and action.stage > 0 and (action.stage - 1) % pp == receiver
        ):
            messages.append(("B", action.stage - 1, action.microbatch))
    return messages


class Inbox:
    """One step's receives of one pipeline rank (see the module docstring)."""

    def __init__(
        self,
        p2p: P2P,
        pp_rank: int,
        pp: int,
        num_stages: int,
        actions_by_rank: Mapping[int, Sequence[Action]],
        *,
        forward_only: bool,
        fixed_shapes: bool,
        grad_meta: Callable[[int, int], Metas | None],
        ahead: int,
    ) -> None:
        self.p2p, self.fixed_shapes, self.grad_meta, self.ahead = p2p, fixed_shapes, grad_meta, ahead
        previous, following = (pp_rank - 1) % pp, (pp_rank + 1) % pp
        self._peer_of = {"F": previous, "B": following}
        self._global_rank = {previous: p2p.prev_rank, following: p2p.next_rank}
        self._queues = {
            peer: messages_from(actions_by_rank[peer], pp_rank, pp, num_stages, forward_only)
            for peer in {previous, following}
            if peer != pp_rank
        }
        self._posted_count = dict.fromkeys(self._queues, 0)
        self._taken_count = dict.fromkeys(self._queues, 0)
        self._posted: dict[Key, Receive] = {}
        self._activation_meta: dict[int, Metas] = {}

    def take(self, key: Key) -> tuple[torch.Tensor, ...]:
        """Message ``key``, once every receive its sender sends before it is posted."""
        peer = self._peer_of[key[0]]
        while key not in self._posted:
            if not self._post_next(peer, blocking=True):
                raise RuntimeError(f"pipeline: {key} is not among the messages pipeline rank {peer} sends this step")
        receive = self._posted.pop(key)
        tensor = receive.wait()
        self._learn(key, receive)
        self._taken_count[peer] += 1
        return tensor

    def post_ahead(self) -> None:
        """Post, without waiting, the receives whose sizes are known, up to ``ahead`` per peer not yet taken."""
        for peer in self._queues:
            while self._posted_count[peer] - self._taken_count[peer] < self.ahead:
                if not self._post_next(peer, blocking=False):
                    break

    def _learn(self, key: Key, receive: Receive) -> None:
        """With fixed shapes, a stage's first activation (its payload posted) gives the shape of the rest."""
        if self.fixed_shapes and key[0] == "F":
            self._activation_meta.setdefault(key[1], receive.metas)

    def _post_next(self, peer: int, *, blocking: bool) -> bool:
        """Post the next receive from ``peer``; False where it cannot be posted yet (without ``blocking``: the one
        before it still waits for its header; or its size is not known)."""
        queue, index = self._queues[peer], self._posted_count[peer]
        if index >= len(queue):
            return False
        before = self._posted.get(queue[index - 1]) if index else None
        if before is not None and before.has_header:
            if not (blocking or before.header_arrived()):
                return False
            before.resolve()  # its payload's receive is posted before anything the peer sends after it
            self._learn(queue[index - 1], before)
        kind, stage, microbatch = key = queue[index]
        if kind == "F":
            meta = self._activation_meta.get(stage)  # None: a header comes first
        else:
            meta = self.grad_meta(stage, microbatch)
            if meta is None:
                if blocking:  # a valid schedule never needs a grad before its forward ran
                    raise RuntimeError(f"pipeline stage {stage}: microbatch {microbatch}'s grad due before its forward")
                return False
        self._posted[key] = self.p2p.post(self._global_rank[peer], message_tag(kind, stage, microbatch), meta)
        self._posted_count[peer] = index + 1
        return True
