"""Simulate a schedule's action lists: timeline, bubble fraction, in-flight microbatches, deadlocks.

Unit-time model: a forward of one chunk takes ``1 / v`` and a backward ``2 / v`` (a chunk holds ``1 / v`` of a rank's
layers), split into an input-grad ``I`` and a weight-grad ``W`` of ``1 / v`` each; communication is free. Each rank
runs its actions strictly in order, an action starting as soon as the rank is free and its inputs exist (forward of
stage ``s`` needs forward ``s - 1`` of the same microbatch; ``B`` or ``I`` of ``s`` needs its own forward and the
input grad of ``s + 1``, sent by its ``B`` or ``I``; ``W`` needs its ``I``). A schedule that stops making progress is
a deadlock, reported with the step x rank grid. Bubble fraction: ``(makespan - busy) / busy`` with ``busy = 3 * m``
per rank, which for 1F1B is ``(pp - 1) / m``, for interleaved 1F1B ``(pp - 1) / (v * m)`` and for ZB-H1 a third of
1F1B's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from meshpar.pipeline.schedule_ir import ACCUMULATES_WEIGHT_GRADS, SENDS_GRAD, Action, RankActions, build_actions

_UNITS = {"F": 1, "B": 2, "I": 1, "W": 1}  # an action's duration, in forwards of one chunk
_COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}


@dataclass
class Timeline:
    pp: int
    v: int
    m: int
    actions: RankActions
    start: dict[tuple[int, Action], Fraction] = field(default_factory=dict)
    makespan: Fraction = Fraction(0)

    @property
    def bubble_fraction(self) -> float:
        busy = 3 * self.m
        return float((self.makespan - busy) / busy)

    def peak_in_flight(self) -> dict[int, int]:
        """Per rank: the most microbatch-chunks whose forward ran and whose weight grads have not (``B`` or ``W``):
        their activations are held."""
        peaks = {}
        for rank, actions in self.actions.items():
            live = peak = 0
            for action in actions:
                live += 1 if action.kind == "F" else -(action.kind in ACCUMULATES_WEIGHT_GRADS)
                peak = max(peak, live)
            peaks[rank] = peak
        return peaks

    def grid(self) -> str:
        """Text chart: one row per rank, two columns per chunk forward's time, each action's cells its kind (F, B,
        I, W) with the microbatch's last digit in the first; ``.`` is idle."""
        scale = 2 * self.v  # columns per unit time
        width = int(self.makespan * scale)
        rows = []
        for rank, actions in self.actions.items():
            cells = ["."] * width
            for action in actions:
                begin = int(self.start[(rank, action)] * scale)
                for col in range(begin, begin + 2 * _UNITS[action.kind]):
                    cells[col] = action.kind
                cells[begin] = str(action.microbatch % 10)
            rows.append(f"rank {rank}: " + "".join(cells))
        return "\n".join(rows)

    def plot(self, path: str) -> None:
        """A Gantt chart PNG (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(6.0, float(self.makespan) * 0.4), 0.6 * self.pp + 1))
        for rank, actions in self.actions.items():
            for action in actions:
                duration, color = Fraction(_UNITS[action.kind], self.v), _COLORS[action.kind]
                begin = float(self.start[(rank, action)])
                ax.barh(rank, float(duration), left=begin, color=color, edgecolor="black")
                ax.text(begin + float(duration) / 2, rank, str(action), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(self.pp), [f"rank {r}" for r in range(self.pp)])
        ax.invert_yaxis()
        ax.set_xlabel("time (forward of a whole rank's layers = 1)")
        ax.set_title(f"pp={self.pp} v={self.v} m={self.m} bubble={self.bubble_fraction:.3f}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


class ScheduleDeadlockError(RuntimeError):
    pass


def simulate(actions: RankActions, pp: int, v: int, m: int) -> Timeline:
    """Run the action lists under the unit-time model; raises ``ScheduleDeadlockError`` with the grid of what ran."""
    num_stages = pp * v
    # when each (event, stage, microbatch) happened: "F" its forward, "G" its input grad, "I" its input-grad pass
    done: dict[tuple[str, int, int], Fraction] = {}
    position = dict.fromkeys(actions, 0)
    free_at = dict.fromkeys(actions, Fraction(0))
    timeline = Timeline(pp, v, m, actions)
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank, rank_actions in actions.items():
            if position[rank] == len(rank_actions):
                continue
            action = rank_actions[position[rank]]
            kind, stage, mb = action
            if kind == "F":
                deps = [("F", stage - 1, mb)] if stage > 0 else []
            elif kind == "W":
                deps = [("I", stage, mb)]
            else:
                deps = [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < num_stages - 1 else [])
            if any(dep not in done for dep in deps):
                continue
            begin = max([free_at[rank], *(done[dep] for dep in deps)])
            end = begin + Fraction(_UNITS[kind], v)
            timeline.start[(rank, action)] = begin
            done[(kind, stage, mb)] = end
            if kind in SENDS_GRAD:
                done[("G", stage, mb)] = end
            free_at[rank] = end
            position[rank] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {r: str(a[position[r]]) for r, a in actions.items() if position[r] < len(a)}
            ran = "\n".join(f"rank {r}: " + " ".join(str(x) for x in a[: position[r]]) for r, a in actions.items())
            raise ScheduleDeadlockError(f"schedule deadlocks; each rank waits on {stuck}. What ran:\n{ran}")
    timeline.makespan = max(free_at.values())
    return timeline


def inspect_schedule(schedule: str, pp: int, v: int, m: int) -> Timeline:
    """Build and simulate ``schedule`` (see :data:`meshpar.pipeline.schedule_ir.SCHEDULES`)."""
    return simulate(build_actions(schedule, pp, v, m), pp, v, m)
