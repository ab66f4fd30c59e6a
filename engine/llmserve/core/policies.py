"""Scheduling policies: the order of the waiting queue (and of the running batch).

A policy is only a sort key; there is one scheduler for all of them. A smaller key runs first
and is preempted last. Keys are fixed for a sequence's lifetime (arrival time, prompt +
max_tokens and priority never change), so a heap ordered once stays valid.

Every key ends with ``(metrics.arrival_time, seq._arrival_index)``: ties break by arrival, and
the insertion counter the scheduler assigns makes every key unique.

* ``fcfs``     -- first come, first served: ``(arrival_time, index)``.
* ``sjf``      -- shortest job first, by the most tokens a request can hold:
  ``(prompt + max_tokens, arrival_time, index)`` (the true output length is unknown up front).
* ``priority`` -- lower ``seq.priority`` first: ``(priority, arrival_time, index)``.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from .sequence import Sequence


class SchedulingPolicy:
    """Base class: ``key(seq)`` orders sequences, smallest first."""

    name = "base"

    def key(self, seq: "Sequence") -> tuple:
        raise NotImplementedError

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"{type(self).__name__}()"


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (arrival time, then insertion order)."""

    name = "fcfs"

    def key(self, seq: "Sequence") -> tuple:
        return (seq.metrics.arrival_time, seq._arrival_index)


class SJFPolicy(SchedulingPolicy):
    """Shortest job first: smallest ``seq.max_total_tokens`` (prompt + max_tokens), then arrival."""

    name = "sjf"

    def key(self, seq: "Sequence") -> tuple:
        return (seq.max_total_tokens, seq.metrics.arrival_time, seq._arrival_index)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``seq.priority`` value first, then arrival."""

    name = "priority"

    def key(self, seq: "Sequence") -> tuple:
        return (seq.priority, seq.metrics.arrival_time, seq._arrival_index)


POLICY_REGISTRY: dict[str, type[SchedulingPolicy]] = {
    FCFSPolicy.name: FCFSPolicy,
    SJFPolicy.name: SJFPolicy,
    PriorityPolicy.name: PriorityPolicy,
}


def get_policy(name: str) -> SchedulingPolicy:
    """The policy registered under ``name``.

    Raises:
        ValueError: unknown name; the message lists the supported ones.
    """
    try:
        return POLICY_REGISTRY[name]()
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown scheduling policy {name!r}; supported: {sorted(POLICY_REGISTRY)}") from None


class WaitingQueue:
    """The waiting sequences as a binary heap in policy order, with a front lane.

    Entry key: ``(lane, *policy.key(seq))`` where lane 0 holds sequences pushed with
    ``front=True`` (preempted ones) and lane 1 everything else, so a preempted sequence is
    readmitted before any request that has never run; within a lane the policy decides.

    Complexity: ``push``/``pop`` O(log n), ``peek`` amortised O(1), ``remove`` O(1) (lazy: the
    entry is marked dead and skipped when it reaches the top), ``len`` O(1), iteration
    O(n log n) (inspection only).
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._heap: list[list] = []                 # [key, push_count, seq, alive]
        self._entries: dict[str, list] = {}         # request_id -> live entry
        self._push_count = 0                        # unique tie-break: never compares sequences

    def push(self, seq: "Sequence", front: bool = False) -> None:
        if seq.request_id in self._entries:
            raise ValueError(f"request {seq.request_id!r} is already waiting")
        entry = [(0 if front else 1, *self.policy.key(seq)), self._push_count, seq, True]
        self._push_count += 1
        self._entries[seq.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _drop_dead(self) -> None:
        while self._heap and not self._heap[0][3]:
            heapq.heappop(self._heap)

    def peek(self) -> "Sequence | None":
        """The next sequence to admit, or None when empty."""
        self._drop_dead()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> "Sequence":
        """Remove and return the next sequence.

        Raises:
            IndexError: the queue is empty.
        """
        self._drop_dead()
        if not self._heap:
            raise IndexError("pop from an empty waiting queue")
        _key, _count, seq, _alive = heapq.heappop(self._heap)
        del self._entries[seq.request_id]
        return seq

    def remove(self, seq: "Sequence") -> bool:
        """Remove ``seq`` if present; returns whether it was."""
        entry = self._entries.pop(seq.request_id, None)
        if entry is None or entry[2] is not seq:
            if entry is not None:  # same id, different object: put it back untouched
                self._entries[seq.request_id] = entry
            return False
        entry[3] = False
        return True

    def __contains__(self, seq: "Sequence") -> bool:
        entry = self._entries.get(seq.request_id)
        return entry is not None and entry[2] is seq

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator["Sequence"]:
        """Live sequences in admission order (sorted copy; O(n log n))."""
        return iter([e[2] for e in sorted(self._entries.values(), key=lambda e: (e[0], e[1]))])
