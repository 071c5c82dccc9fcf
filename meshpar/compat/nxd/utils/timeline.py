"""``neuronx_distributed.utils.timeline``: a Chrome-trace timeline (``chrome://tracing``, Perfetto) of named spans.

``mark_event_start(label)`` / ``mark_event_end(label)`` time a span on this rank; ``mark_step_end()`` collects every
recording rank's spans of the step (:meth:`Timeline._collect_events_for_all_ranks`) and rank 0 appends them to
``trace_file_path`` as begin / end events (microsecond timestamps, one ``pid`` per rank). The file is a JSON array
left open, as the trace viewers accept. Without a path nothing is recorded.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from typing import Any


class Event:
    def __init__(self, label: str, rank: int, start: float = -1, end: float = -1) -> None:
        self.label, self.rank, self.start, self.end = label, rank, start, end


class Timeline(ABC):
    def __init__(self, trace_file_path: str | None, rank: int) -> None:
        self.enabled = trace_file_path is not None
        self.all_rank_events: list[dict[str, Event]] | None = None
        self.current_rank_events: dict[str, Event] = {}
        if not self.enabled:
            return
        self.trace_file_path, self.rank, self.step = trace_file_path, rank, 0
        if self.should_record and self.rank == 0:
            with open(self.trace_file_path, "a") as f:
                f.write("[")

    @property
    @abstractmethod
    def should_record(self) -> bool: ...

    @abstractmethod
    def _collect_events_for_all_ranks(self) -> None:
        """Set ``all_rank_events`` to every recording rank's ``current_rank_events``."""

    def mark_event_start(self, label: str) -> None:
        if not self.should_record:
            return
        if label in self.current_rank_events:
            raise ValueError(f"timeline event {label!r} started twice in one step")
        self.current_rank_events[label] = Event(label, self.rank, start=self._get_timestamp())

    def mark_event_end(self, label: str) -> None:
        if not self.should_record:
            return
        if label not in self.current_rank_events:
            raise ValueError(f"timeline event {label!r} ended without a start")
        self.current_rank_events[label].end = self._get_timestamp()

    def mark_step_end(self) -> None:
        if not self.should_record:
            return
        self._collect_events_for_all_ranks()
        if self.rank == 0:
            self._dump_events()
        self.current_rank_events, self.all_rank_events = {}, None
        self.step += 1

    def _dump_events(self) -> None:
        with open(self.trace_file_path, "a") as f:
            for events in self.all_rank_events or []:
                for event in events.values():
                    f.writelines(self._creat_sync_event(event))

    def _get_timestamp(self) -> float:
        return time.time() * 1_000_000

    def _creat_sync_event(self, event: Event) -> list[str]:
        if event.start == -1 or event.end == -1:
            raise ValueError(f"timeline event {event.label!r} was not both started and ended")
        return [
            json.dumps({"cat": "comp", "ph": phase, "name": event.label, "ts": stamp, "tid": 0, "pid": event.rank})
            + ",\n"
            for phase, stamp in (("B", event.start), ("E", event.end))
        ]

    def _create_instant_event(self, label: str, timestamp: float) -> str:
        record: dict[str, Any] = {"cat": "comp", "ph": "i", "name": label, "ts": timestamp, "tid": self.step,
                                  "pid": self.rank, "s": "p"}  # fmt: skip
        return json.dumps(record) + ",\n"


__all__ = ["Event", "Timeline"]
