"""The step guard's cost: training-step time with ``[health]`` on against off, in one trainer.

The guard adds, per step, one all-reduce of two numbers (none on one process), a few tensor ops
for the spike window, and the optimizer's ``found_inf`` input; the host reads its records only
on log steps. One real trainer (fused optimizer, one torch thread: steadier on a 2-core VM)
runs its steps with the guard on and off in turn (the guard detached, ``found_inf`` cleared),
pairing step k (on) with step k+1 (off) and flipping the order every pair (on-off, off-on), so
that both see the same weights, data stream, allocator and machine state; every 10th "on" step
also reads the guard on the host, as a log step does. Per pair, on / off - 1 on wall and
process-CPU clocks; the last line is the median over the pairs (goal <= 1%). The table also
gives the guard's own time per step (its calls timed directly: on CPU they are synchronous).

    .venv/bin/python bench/health.py [--pairs 100] [--flavor debugmodel] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from _common import add_quick, final_line

from titan_core.resolve import parse_args
from titan_core.trainer import Trainer

LOG_FREQ = 10


class TimedGuard:
    """The trainer's guard, its calls timed (wall seconds summed in ``seconds``)."""

    def __init__(self, guard: Any) -> None:
        self.guard, self.seconds = guard, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.guard, name)

    def check(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.guard.check(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def flush(self) -> Any:
        start = time.perf_counter()
        try:
            return self.guard.flush()
        finally:
            self.seconds += time.perf_counter() - start


def one_step(trainer: Trainer, data: Any, guard: Any, step: int) -> tuple[float, float]:
    """(wall, cpu) seconds of one training step with ``guard`` (None: off)."""
    trainer.guard = guard
    trainer.optimizer.found_inf = None  # type: ignore[attr-defined]
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train_step([next(data)], step)
    if guard is not None and step % LOG_FREQ == 0:
        guard.flush()  # the log step's read
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    """Run paired steps and print a table; the overhead is on the last line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", type=int, default=100)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    add_quick(p)
    a = p.parse_args()
    if a.quick:
        a.pairs, a.flavor, a.batch, a.seq = 10, "debugmodel_tiny", 2, 64
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as out:
        argv = ["--module", "llama3", "--config", "llama3_debugmodel", "--model.flavor", a.flavor,
                "--training.local_batch_size", str(a.batch), "--training.seq_len", str(a.seq),
                "--job.dump_folder", out, "--checkpoint.no_enable", "--validation.no_enable",
                "--optimizer.implementation", "fused", "--health.enable"]  # fmt: skip
        trainer = Trainer(parse_args(argv))
        try:
            guard, data = TimedGuard(trainer.guard), iter(trainer.dataloader)
            for step in range(1, 2 * LOG_FREQ + 1):  # warm-up: allocations, caches
                one_step(trainer, data, guard if step % 2 else None, step)
            guard.seconds = 0.0
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            step = 2 * LOG_FREQ + 1
            for k in range(a.pairs):
                for on in (True, False) if k % 2 == 0 else (False, True):
                    times[on].append(one_step(trainer, data, guard if on else None, step))
                    step += 1
        finally:
            trainer.close()
    pairs = list(zip(times[True], times[False], strict=True))
    wall = statistics.median(n[0] / f[0] - 1 for n, f in pairs)
    cpu = statistics.median(n[1] / f[1] - 1 for n, f in pairs)
    tokens = a.batch * a.seq
    head = "| guard | wall ms/step | wall tok/s | cpu-time tok/s |"
    print(f"\n{head}   (medians of {a.pairs} pairs of steps)")
    print("|-------|------------:|-----------:|---------------:|")
    for name, rows in (("on", times[True]), ("off", times[False])):
        w, c = statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows)
        print(f"| {name:5} | {1e3 * w:11.2f} | {tokens / w:10,.0f} | {tokens / c:14,.0f} |")
    on_total = sum(x[0] for x in times[True])
    own = guard.seconds / len(times[True])
    print(f"threads={a.threads} flavor={a.flavor} batch={a.batch} seq={a.seq}")
    print(f"the guard's own time: {1e3 * own:.3f} ms/step = {guard.seconds / on_total:.3%} of it")
    print(f"cpu-time overhead of the guard (median of pairs): {cpu:+.2%}")
    final_line("guard overhead (wall, median of paired steps)", f"{wall:.2%}", "<= 1%")


if __name__ == "__main__":
    main()
