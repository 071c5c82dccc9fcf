"""Pipeline schedules as data: per-rank lists of compute actions.

An action is ``(kind, stage, microbatch)`` with kind ``"F"`` (forward), ``"B"`` (full backward), or a backward split in
two: ``"I"`` (the grad of the stage's input only, sent on at once) and ``"W"`` (the same microbatch's weight grads,
any time later; zero-bubble schedules fill the pipeline's idle slots with them). Stage ``s`` of
``pp * v`` stages lives on rank ``s % pp`` (rank ``r`` owns chunks ``r, r + pp, r + 2pp, ...``). These lists are
what :mod:`meshpar.pipeline.inspector` simulates and what :mod:`meshpar.pipeline.executor` runs (and, as a
cross-check in the tests, torch's runtime after its pass adds the sends and receives).

Each schedule is three small steps per rank: the forward order, the backward order, and how they interleave
(warm-up forwards, steady one-forward-one-backward, cool-down backwards).
"""

from __future__ import annotations

from typing import NamedTuple

from meshpar.parallel_dims import check_virtual_pipeline_size


class Action(NamedTuple):
    kind: str  # "F", "B", or "I" then "W"
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


RankActions = dict[int, list[Action]]


def check_schedule_args(pp: int, v: int, m: int, forward_only: bool = False) -> None:
    """Sizes a schedule can run. An interleaved training schedule (``v > 1``) needs ``m >= pp``: each chunk's
    round must fill the pipeline before the next chunk's starts. Plain 1F1B / GPipe / ZB-H1 and forward-only runs
    take any ``m`` (NxD's 1F1B does too): with fewer microbatches than stages the later ranks only idle longer."""
    if pp < 1 or v < 1 or m < 1:
        raise ValueError(f"pp, virtual_pipeline_size and num_microbatches must be >= 1, got {pp}, {v}, {m}")
    check_virtual_pipeline_size(pp, v)
    if pp > 1 and m < pp and not forward_only and v > 1:
        raise ValueError(
            f"num_microbatches={m} is smaller than pp={pp}: interleaved 1F1B needs at least {pp} microbatches (one "
            "round per chunk)"
        )


def _rounds(m: int, pp: int) -> list[range]:
    """Microbatches in ``m // pp`` consecutive rounds of at least ``pp`` each, sizes differing by at most one
    (larger rounds first). With ``m % pp == 0`` these are Megatron's rounds of exactly ``pp``; otherwise every
    round is still wide enough to keep all ranks busy, so any ``m >= pp`` works (apex and NxD require a multiple).
    The price of a wider first round ``R`` is ``v * (R - pp)`` more chunk activations in flight during warm-up.
    """
    n_rounds = max(1, m // pp)
    base, extra = divmod(m, n_rounds)
    rounds, start = [], 0
    for index in range(n_rounds):
        size = base + (1 if index < extra else 0)
        rounds.append(range(start, start + size))
        start += size
    return rounds


def forward_order(rank: int, pp: int, v: int, m: int) -> list[Action]:
    """Depth-first per round: chunk 0 for the round's microbatches, then chunk 1, ... (Megatron's order)."""
    return [Action("F", chunk * pp + rank, mb) for group in _rounds(m, pp) for chunk in range(v) for mb in group]


def backward_order(rank: int, pp: int, v: int, m: int) -> list[Action]:
    return [
        Action("B", chunk * pp + rank, mb) for group in _rounds(m, pp) for chunk in reversed(range(v)) for mb in group
    ]


def warmup_forwards(rank: int, pp: int, v: int, m: int) -> int:
    """Forwards before the first backward: ``pp - rank - 1`` for 1F1B; for interleaved 1F1B Megatron's
    ``(pp - rank - 1) * 2 + (v - 1) * R`` with ``R`` the first round's size (``pp`` when ``m % pp == 0``), capped at
    all ``v * m`` forwards."""
    total = v * m
    if v == 1:
        return min(pp - rank - 1, total)
    return min((pp - rank - 1) * 2 + (v - 1) * len(_rounds(m, pp)[0]), total)


def one_f_one_b(rank: int, pp: int, v: int, m: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    forwards, backwards = forward_order(rank, pp, v, m), backward_order(rank, pp, v, m)
    warmup = warmup_forwards(rank, pp, v, m)
    actions = forwards[:warmup]
    for fwd, bwd in zip(forwards[warmup:], backwards, strict=False):
        actions += [fwd, bwd]
    actions += backwards[len(forwards) - warmup :]
    return actions


def zero_bubble_h1(rank: int, pp: int, v: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with every backward split into ``I`` then
    ``W``. Input grads travel upstream as soon as ``I`` ran, so the next rank's backward starts a weight-grad's time
    earlier; rank ``r`` holds back its first ``r`` weight-grad passes and runs them in the cool-down, where 1F1B idles.
    Activations in flight never exceed 1F1B's first rank's (``pp``): a microbatch's are freed by its ``W``. With
    forward, input-grad and weight-grad passes of equal cost the bubble is a third of 1F1B's."""
    forwards = forward_order(rank, pp, 1, m)
    inputs = [Action("I", a.stage, a.microbatch) for a in backward_order(rank, pp, 1, m)]
    weights = [Action("W", a.stage, a.microbatch) for a in inputs]
    warmup = warmup_forwards(rank, pp, 1, m)
    actions, done_w = list(forwards[:warmup]), 0
    for index, grad in enumerate(inputs):
        if warmup + index < len(forwards):
            actions.append(forwards[warmup + index])
        actions.append(grad)
        if index >= rank:  # the first ``rank`` weight passes wait for the cool-down
            actions.append(weights[done_w])
            done_w += 1
    return actions + weights[done_w:]


def gpipe(rank: int, pp: int, v: int, m: int) -> list[Action]:
    """All forwards, then all backwards (in reverse microbatch order per stage)."""
    return forward_order(rank, pp, v, m) + list(reversed(backward_order(rank, pp, v, m)))


def forward_only(rank: int, pp: int, v: int, m: int) -> list[Action]:
    return forward_order(rank, pp, v, m)


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": one_f_one_b,
    "zb_h1": zero_bubble_h1,
    "forward_only": forward_only,
}
SENDS_GRAD = ("B", "I")  # the kinds that send the stage's input grad upstream
ACCUMULATES_WEIGHT_GRADS = ("B", "W")


def build_actions(schedule: str, pp: int, v: int, m: int) -> RankActions:
    """The action list of every rank for ``schedule`` in ``SCHEDULES``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if schedule in ("1f1b", "zb_h1", "gpipe") and v != 1:
        raise ValueError(f"{schedule} runs one stage per rank; use interleaved_1f1b for virtual_pipeline_size > 1")
    check_schedule_args(pp, v, m, forward_only=schedule == "forward_only")
    return {rank: SCHEDULES[schedule](rank, pp, v, m) for rank in range(pp)}
