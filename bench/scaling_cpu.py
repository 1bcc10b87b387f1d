"""FSDP scaling on CPU: tokens/s of 1, 2 and 4 processes and the efficiency against ideal.

Weak scaling: every rank trains the same per-rank batch, so ideal throughput at N processes is N
times the single process's. Each process gets ``--threads`` intra-op threads (default 1) so the
runs compare like with like; on a machine with fewer cores than N * threads the efficiency
measures oversubscription, and the table says how many cores there were.

    .venv/bin/python bench/scaling_cpu.py [--procs 1 2 4] [--steps 30] [--flavor debugmodel]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import add_quick, final_line

GOAL = 0.8  # weak-scaling efficiency at the most processes the cores hold, one thread each


def run(nproc: int, args: argparse.Namespace, dump: Path) -> float:
    """Total tokens/s (all ranks) of one FSDP run: median of the logged steps after warm-up."""
    train = [
        "-m",
        "titan_core.train",
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--model.flavor",
        args.flavor,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(args.steps),
        "--training.local_batch_size",
        str(args.batch),
        "--training.seq_len",
        str(args.seq_len),
        "--metrics.log_freq",
        "1",
        "--validation.no_enable",
        "--checkpoint.no_enable",
        "--profiling.no_enable_profiling",
    ]
    if nproc == 1:
        cmd = [sys.executable, *train]
    else:
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        cmd = [sys.executable, *launcher, "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
        cmd += train
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    per_rank = [r["tps"] for r in rows if r["step"] > args.warmup]
    return statistics.median(per_rank) * nproc  # tps is per rank


def main() -> None:
    """Run each process count and print tokens/s, speed-up and efficiency."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--flavor", default="debugmodel")
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.procs, args.steps, args.warmup, args.batch, args.seq_len = [1, 2], 4, 1, 2, 64
        args.flavor = "debugmodel_tiny"
    results: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.procs:
            results[nproc] = run(nproc, args, Path(tmp) / f"n{nproc}")
    base = results[args.procs[0]] / args.procs[0]
    print(
        f"FSDP weak scaling, llama3 {args.flavor}, batch {args.batch} x seq {args.seq_len} per "
        f"rank, {args.threads} thread(s)/process, {os.cpu_count()} cores"
    )
    print(f"{'procs':>5} {'tokens/s':>10} {'speed-up':>9} {'efficiency':>10}")
    for nproc, tps in results.items():
        speedup = tps / base
        print(f"{nproc:>5} {tps:>10,.0f} {speedup:>9.2f} {speedup / nproc:>10.0%}")
    cores = os.cpu_count() or 1
    fits = [n for n in args.procs if n * args.threads <= cores] or args.procs[:1]
    n = max(fits)
    efficiency = results[n] / (base * n)
    final_line(f"efficiency at {n} processes ({cores} cores)", f"{efficiency:.2f}", f">= {GOAL}")


if __name__ == "__main__":
    main()
