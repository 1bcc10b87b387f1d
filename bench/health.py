"""The step guard's cost: training-step time with ``[health]`` on against off, in one trainer.

The guard adds, per step, one all-reduce of two numbers (none on one process), a few tensor ops
for the spike window, and the optimizer's ``found_inf`` input; the host reads its records only
on log steps. One real trainer (fused optimizer, one torch thread: steadier on a 2-core VM)
runs its steps with the guard on and off in turn (the guard detached, ``found_inf`` cleared):
step k (on) is paired with step k+1 (off), and the order flips every pair (on-off, off-on), so
that both see the same weights, data stream, allocator and machine state; every 10th "on" step
also reads the guard on the host, as a log step does. Python's collector is off during the
steps and runs between them every ``training.gc_freq`` steps, as in ``Trainer.train``.

Per pair, on / off - 1 (wall clock). The estimate is order-balanced: the mean of the median over
the on-first pairs and the median over the off-first pairs, so that an effect of a step's
position in its pair cancels. Between the pairs, the same is done with the guard off in both
steps of a pair (an A/A check): its figure is the method's own error. The table also gives the
guard's own time per step (its calls timed directly: on CPU they are synchronous). The last
line is the on/off estimate (goal <= 1%).

    .venv/bin/python bench/health.py [--pairs 60] [--flavor debugmodel] [--quick]
"""

from __future__ import annotations

import argparse
import gc
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
    """(wall, cpu) seconds of one training step with ``guard`` (None: off). As in the trainer's
    loop, Python's collector runs between steps (every ``training.gc_freq``), not inside one."""
    if step % trainer.cfg.training.gc_freq == 0:
        gc.collect(1)
    trainer.guard = guard
    trainer.optimizer.found_inf = None  # type: ignore[attr-defined]
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train_step([next(data)], step)
    if guard is not None and step % LOG_FREQ == 0:
        guard.flush()  # the log step's read
    return time.perf_counter() - start, time.process_time() - cpu


def balanced(pairs: list[tuple[float, float]]) -> float:
    """Order-balanced overhead of A over B from pairs (A, B) whose order alternated, starting
    with A first: the mean of the medians of A / B - 1 over each order."""
    ratios = [a / b - 1 for a, b in pairs]
    return (statistics.median(ratios[0::2]) + statistics.median(ratios[1::2])) / 2


def main() -> None:
    """Run paired steps and print a table; the overhead is on the last line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", type=int, default=60)
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
        gc.disable()  # as Trainer.train does: a collection is a pause of its own, not a step's
        try:
            guard, data = TimedGuard(trainer.guard), iter(trainer.dataloader)
            for step in range(1, 2 * LOG_FREQ + 1):  # warm-up: allocations, caches
                one_step(trainer, data, guard if step % 2 else None, step)
            guard.seconds = 0.0
            on_off: list[tuple[float, float]] = []  # (on, off) wall seconds
            a_a: list[tuple[float, float]] = []  # (off "A", off "B")
            step = 2 * LOG_FREQ + 1
            for k in range(a.pairs):
                for pairs, kinds in ((on_off, (guard, None)), (a_a, (None, None))):
                    order = (0, 1) if k % 2 == 0 else (1, 0)
                    t = [0.0, 0.0]
                    for i in order:
                        t[i] = one_step(trainer, data, kinds[i], step)[0]
                        step += 1
                    pairs.append((t[0], t[1]))
        finally:
            gc.enable()
            trainer.close()
    wall, noise = balanced(on_off), balanced(a_a)
    tokens = a.batch * a.seq
    head = "| guard | wall ms/step | wall tok/s |"
    print(f"\n{head}   (medians of {a.pairs} pairs of steps)")
    print("|-------|------------:|-----------:|")
    for name, rows in (("on", [x[0] for x in on_off]), ("off", [x[1] for x in on_off])):
        w = statistics.median(rows)
        print(f"| {name:5} | {1e3 * w:11.2f} | {tokens / w:10,.0f} |")
    on_total = sum(x[0] for x in on_off)
    own = guard.seconds / len(on_off)
    print(f"threads={a.threads} flavor={a.flavor} batch={a.batch} seq={a.seq}")
    print(f"the guard's own time: {1e3 * own:.3f} ms/step = {guard.seconds / on_total:.3%} of it")
    print(f"A/A check, guard off in both steps (the method's error): {noise:+.2%}")
    final_line(
        "guard overhead (wall, order-balanced median of paired steps)", f"{wall:.2%}", "<= 1%"
    )


if __name__ == "__main__":
    main()
