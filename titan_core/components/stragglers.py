"""Stragglers: the rank that makes every other rank wait, named at log steps.

Each rank times its steps on the host, in three parts:

- **data wait**: waiting for the next batch;
- **collective wait**: the time its main thread was blocked during the training step, which is
  mostly waiting for collectives (a rank waiting on a late peer sleeps in gloo). Linux's
  per-thread scheduler statistics give the time the thread ran or was ready to run; the rest of
  the wall time it was blocked. Where they are missing, the thread's CPU time stands in;
- **compute**: the rest of the training step (on a CPU, or ready and waiting for one).

In a synchronous job every rank's step takes the same wall time: the slow rank is the one that
waits least, so its compute is longer. At log steps the ranks all-gather their means over the
interval (one small collective where the host synchronizes anyway; at least ``MIN_STEPS`` steps
each) and a rank whose compute or data wait per step exceeds ``health.straggler_factor`` x the
median of the other ranks' of its pipeline stage (stages do different work) is named, if it is
also slower by at least ``MIN_GAP_S`` and ``MIN_SHARE`` of their step (a slowness that costs the
job time). On CUDA the host does not wait in collectives (kernels run asynchronously), so only
host-side slowness shows; docs/health.md says more.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MIN_GAP_S = 0.002  # a rank must be slower by at least this per step: timer noise on tiny steps
MIN_SHARE = 0.05  # ... and by this share of the others' step: a slowness that costs the job time
MIN_STEPS = 5  # timed steps a comparison needs; fewer wait for the next log step (noise)
_SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on a CPU, ns ready in a run queue, timeslices
_QUANTITIES = ("compute", "data_wait")


class ThreadClock:
    """Seconds the calling thread ran or was ready to run (not blocked), as a running total."""

    def __init__(self) -> None:
        try:  # opened by the thread it measures (thread-self resolves at open)
            self._fd: int | None = os.open(_SCHEDSTAT, os.O_RDONLY)
            self.busy()
        except (OSError, ValueError):
            self._fd = None

    def busy(self) -> float:
        if self._fd is None:
            return time.thread_time()
        run, ready, _ = os.pread(self._fd, 128, 0).split()
        return (int(run) + int(ready)) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Straggler:
    """One rank slower than the others over a log interval."""

    step: int
    rank: int
    quantity: str  # compute | data_wait
    value: float  # seconds per step
    median: float  # the other ranks' median, seconds per step
    timings: dict[str, float]  # this rank's data wait, collective wait and compute per step

    def line(self) -> str:
        t = self.timings
        ratio = self.value / self.median if self.median > 0 else float("inf")
        return (
            f"health: step {self.step}: straggler rank {self.rank}: "
            f"{self.quantity.replace('_', ' ')} {self.value * 1e3:.1f} ms/step, {ratio:.1f}x "
            f"the other ranks' median ({self.median * 1e3:.1f} ms); its data wait "
            f"{t['data_wait'] * 1e3:.1f} ms, collective wait {t['collective_wait'] * 1e3:.1f} ms, "
            f"compute {t['compute'] * 1e3:.1f} ms -> reported"
        )

    def row(self) -> dict[str, Any]:
        """The ``health.jsonl`` row."""
        return {
            "step": self.step,
            "quantity": self.quantity,
            "kind": "straggler",
            "value": self.value,
            "median": self.median,
            "ranks": [self.rank],
            "action": "report",
            "timings": self.timings,
        }


class StragglerMonitor:
    """Times this rank's steps; ``report`` compares every rank's at a log step."""

    def __init__(
        self, factor: float, device: torch.device, world_size: int, stage: int = 0
    ) -> None:
        self.factor = factor
        self.stage = stage  # pipeline stage: ranks are compared with those doing the same work
        self.device = device
        self.world_size = world_size
        self.clock = ThreadClock()
        self._sums = [0.0, 0.0, 0.0]  # data wait, collective wait, compute (seconds)
        self._steps = 0
        self._data = 0.0
        self._start: tuple[float, float] | None = None
        self._skip = True  # the first step after a start or a rollback: warm-up, not timed
        self.last_compute = 0.0  # this rank's compute in its last step (the slow-rank drill)
        self.count = 0
        self.slowest: tuple[int, float] = (0, 1.0)  # (rank, compute / others' median) last time

    def add_data(self, seconds: float) -> None:
        self._data += seconds

    def train_begin(self) -> None:
        self._start = (time.perf_counter(), self.clock.busy())

    def train_end(self) -> None:
        assert self._start is not None
        wall = time.perf_counter() - self._start[0]
        busy = self.clock.busy() - self._start[1]
        blocked = min(max(wall - busy, 0.0), wall)
        self.last_compute = wall - blocked
        if not self._skip:
            for i, v in enumerate((self._data, blocked, wall - blocked)):
                self._sums[i] += v
            self._steps += 1
        self._skip, self._data, self._start = False, 0.0, None

    def reset(self) -> None:
        """Drop the interval (after a rollback: the next step warms up again)."""
        self._sums, self._steps, self._data, self._skip = [0.0, 0.0, 0.0], 0, 0.0, True

    def report(self, step: int) -> list[Straggler]:
        """Every rank's mean timings since the last report, compared (a collective: every rank
        calls it at the same steps). Returns the stragglers; empty on one rank."""
        if self.world_size < 2 or self._steps < MIN_STEPS:  # the same count on every rank
            return []
        mine = torch.tensor([self.stage, self._steps, *self._sums], dtype=torch.float64)
        gathered = torch.zeros(self.world_size * 5, dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(gathered, mine.to(self.device))
        rows = gathered.view(self.world_size, 5).tolist()
        self._sums, self._steps = [0.0, 0.0, 0.0], 0
        stages = [r[0] for r in rows]
        per_step = [
            {"data_wait": d / n, "collective_wait": c / n, "compute": x / n}
            for _, n, d, c, x in rows
        ]
        found: list[Straggler] = []
        ratios = [(1.0, 0)]
        for rank, own in enumerate(per_step):
            # Pipeline stages do different work: a rank is compared with its own stage's ranks.
            others = [p for i, p in enumerate(per_step) if i != rank and stages[i] == stages[rank]]
            if not others:
                continue
            step_s = statistics.median(sum(p.values()) for p in others)
            for quantity in _QUANTITIES:
                median = statistics.median(p[quantity] for p in others)
                value = own[quantity]
                if quantity == "compute":
                    ratios.append((value / median if median > 0 else 1.0, rank))
                excess = value - median
                if value > self.factor * median and excess >= max(MIN_GAP_S, MIN_SHARE * step_s):
                    found.append(Straggler(step, rank, quantity, value, median, own))
        ratio, rank = max(ratios)
        self.slowest = (rank, ratio)
        self.count += len(found)
        return found

    def metrics(self) -> dict[str, float]:
        """For the metrics sinks: the slowest rank by compute, its factor over the others'
        median, and how many stragglers were named so far."""
        if self.world_size < 2:
            return {}
        return {
            "health/slowest_rank": float(self.slowest[0]),
            "health/slowest_factor": self.slowest[1],
            "health/stragglers": float(self.count),
        }

    def close(self) -> None:
        self.clock.close()


def slow_down(seconds: float) -> None:
    """The slow-rank drill: keep this rank's CPU busy for ``seconds``, as a slower device or a
    CPU shared with another job would (on CUDA its kernels are then launched that much later)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
