"""In-loop evaluation's cost: its share of a training run's wall time, and its throughput.

    .venv/bin/python bench/inloop_eval.py [--rounds 3] [--steps 100] [--nproc 2]

(a) Share: the demo's training run (``titan train`` of llama3_debugmodel with the demo's
evaluators and settings: ``titan_core.cli.demo.with_demo_evaluators``, 2 processes, 100 steps)
is run end to end; each evaluation's time is the sum of its evaluators' ``eval/<name>/seconds``
in ``metrics.jsonl`` (rank 0's), and the share is their total over the run's wall time, start-up
included. Goal: <= 3%.

(b) Throughput: in one process, the same evaluators on the same model, tokens scored per second
(a held-out batch's ``batch x seq_len`` tokens; a task's request tokens, padding not counted)
against the training forward pass (train mode, with autograd, the training autocast) on the
training shapes, in paired rounds that alternate which goes first. Goal: >= 0.9x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import add_quick, final_line

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--module", "llama3", "--config", "llama3_debugmodel"]
GOAL_SHARE, GOAL_RATIO = 0.03, 0.9
# Quick: the tiny flavor, one process, 10 steps, an evaluation at 0, 5 and 10.
QUICK = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--evaluators.freq", "5"]  # fmt: skip


def demo_args(root: str, steps: int, extra: list[str]) -> list[str]:
    """The demo's training config (recipe, evaluators, settings) writing under ``root``."""
    from titan_core.cli.demo import with_demo_evaluators

    rest = ["--job.dump_folder", root, "--training.steps", str(steps), *extra]
    return [*RECIPE, *with_demo_evaluators(rest, root)]


def share_round(steps: int, nproc: int, extra: list[str]) -> tuple[float, float, int]:
    """One demo training run: (wall seconds, evaluation seconds, evaluations)."""
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as root:
        argv = demo_args(root, steps, extra)
        cmd = [sys.executable, "-m", "titan_core.cli", "train", "--ngpu", str(nproc), *argv]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"titan train failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        (jsonl,) = Path(root).rglob("metrics.jsonl")
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    evals = [
        sum(v for k, v in row.items() if k.startswith("eval/") and k.endswith("/seconds"))
        for row in rows
    ]
    evals = [s for s in evals if s > 0]
    return wall, sum(evals), len(evals)


def throughput_round(trainer: Any, first: str) -> tuple[float, float]:
    """(evaluation, training forward) tokens/s on ``trainer``'s model, in order ``first``."""
    ev, model, cfg = trainer.evaluators, trainer.model, trainer.cfg
    from titan_core.components.evaluators import HeldOutSet

    tokens = 0
    for e in ev.evaluations:
        if isinstance(e, HeldOutSet):
            tokens += sum(b[0].numel() for b in e.batches)
        else:
            tokens += sum(len(r.tokens) - 1 for r in e.requests.requests)
    t = cfg.training
    inputs = torch.randint(0, 1000, (t.local_batch_size, t.seq_len), device=trainer.device)
    forwards = max(1, round(tokens / inputs.numel()))

    def evaluate() -> float:
        start = time.perf_counter()
        ev.run(model, 0)
        return tokens / (time.perf_counter() - start)

    def forward() -> float:
        model.train()
        start = time.perf_counter()
        for _ in range(forwards):
            with trainer._autocast():  # the training forward's autocast, if any
                model(inputs)  # autograd on: the graph is built, then dropped
        return forwards * inputs.numel() / (time.perf_counter() - start)

    if first == "eval":
        e, f = evaluate(), forward()
    else:
        f, e = forward(), evaluate()
    return e, f


def main() -> None:
    """Run the share rounds, then the throughput rounds; the share is on the last line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2)
    add_quick(p)
    a, extra = p.parse_known_args()
    if a.quick:
        a.rounds, a.steps, a.nproc, extra = 1, 10, 1, [*QUICK, *extra]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shares = []
    for r in range(a.rounds):
        wall, evals, n = share_round(a.steps, a.nproc, extra)
        shares.append(evals / wall)
        print(f"round {r}: run {wall:.1f}s, {n} evaluations {evals:.2f}s = {evals / wall:.2%}")
    from titan_core.resolve import parse_args
    from titan_core.trainer import Trainer

    ratios, eval_tps, fwd_tps = [], [], []
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as root:
        flags = ["--metrics.no_enable_jsonl", "--checkpoint.no_enable", "--job.no_save_config"]
        cfg = parse_args(demo_args(root, a.steps, [*flags, *extra]))
        trainer = Trainer(cfg)
        try:
            trainer.evaluators.run(trainer.model, 0)  # warm-up
            for r in range(a.rounds):
                e, f = throughput_round(trainer, "eval" if r % 2 == 0 else "forward")
                eval_tps.append(e)
                fwd_tps.append(f)
                ratios.append(e / f)
                print(f"round {r}: evaluation {e:,.0f} tok/s, training forward {f:,.0f} tok/s")
        finally:
            trainer.close()
    share, ratio = statistics.median(shares), statistics.median(ratios)
    print(f"\n| measure | median of {a.rounds} rounds | goal |")
    print("|---|---:|---|")
    print(f"| evaluation share of the run's wall time | {share:.2%} | <= {GOAL_SHARE:.0%} |")
    print(f"| evaluation tok/s | {statistics.median(eval_tps):,.0f} | |")
    print(f"| training forward tok/s (same shapes) | {statistics.median(fwd_tps):,.0f} | |")
    print(f"| evaluation / training forward | {ratio:.2f}x | >= {GOAL_RATIO}x |")
    print(f"threads={torch.get_num_threads()} steps={a.steps} nproc={a.nproc}")
    final_line("in-loop evaluation / run wall time", f"{share:.2%}", f"<= {GOAL_SHARE:.0%}")


if __name__ == "__main__":
    main()
