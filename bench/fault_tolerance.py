"""One replica group killed mid-run: replica groups (torchft) vs restart-the-world, side by side.

The same job (tiny Llama 3 on the bundled corpus, prepared; 2 replicas) runs four ways on this
host: each mode once undisturbed and once with replica 1 killed (SIGKILL, every one of its
ranks) before step ``--kill-at``, with one restart allowed.

- replica groups: ``fault_tolerance.enable``; group 1's torchrun restarts it and it heals from
  group 0 while group 0 steps on;
- restart-the-world: plain HSDP (``data_parallel_replicate_degree`` 2); torchrun restarts every
  rank and they resume from the newest checkpoint (``--interval``).

The table gives each run's wall time, the wall time the kill cost (killed minus undisturbed,
same mode) and the steps computed twice (rows of a step logged more than once: restart-the-world
redoes the steps since its checkpoint; replica groups redo at most the step the kill broke).
Rounds alternate the modes (``--rounds``). The last line gives the steps the replica groups
recomputed (restart-the-world's in its words).

    python bench/fault_tolerance.py            # 60 steps, kill before step 37, interval 20
    python bench/fault_tolerance.py --quick    # 12 steps, kill before 7, interval 4, the
                                               # killed runs only (CI)
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

from _common import add_quick, final_line


def _prepared(root: Path) -> str:
    from titan_core.data.assets import bundled_corpus_dir, default_tokenizer_path, ensure_assets
    from titan_core.data.prepare import PrepareSpec, prepare

    ensure_assets()
    spec = PrepareSpec(
        sources=(str(bundled_corpus_dir() / "train"),),
        tokenizer_path=str(default_tokenizer_path()),
        root=str(root),
    )
    return prepare(spec, workers=1).url


def _run(mode: str, killed: bool, ns: argparse.Namespace, dataset: str, dump: Path) -> dict:
    from titan_core.distributed.fault_tolerance import KILL_ENV

    argv = [sys.executable, "-m", "titan_core.cli", "train", "--ngpu", str(2 * ns.per_group)]
    argv += ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    argv += ["--job.dump_folder", str(dump), "--training.steps", str(ns.steps)]
    argv += ["--dataloader.dataset", dataset, "--validation.no_enable", "--metrics.log_freq", "1"]
    argv += ["--checkpoint.interval", str(ns.interval), "--launch.max_restarts", "1"]
    argv += ["--parallelism.data_parallel_replicate_degree", "2"]
    if mode == "replica groups":
        argv += ["--fault_tolerance.enable", "--fault_tolerance.heartbeat_timeout_ms", "500"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if killed:  # replica 1: group 1 under fault tolerance; its ranks under plain HSDP
        victims = (
            "1"
            if mode == "replica groups"
            else ",".join(str(r) for r in range(ns.per_group, 2 * ns.per_group))
        )
        env[KILL_ENV] = f"{victims}:{ns.kill_at}"
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"{mode} ({'killed' if killed else 'clean'}) failed:\n"
            f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    steps = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").open()]
    return {"wall": wall, "redone": len(steps) - len(set(steps))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick(parser)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=37)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint interval")
    parser.add_argument("--per-group", type=int, default=1, help="ranks per replica group")
    parser.add_argument("--rounds", type=int, default=1)
    ns = parser.parse_args()
    if ns.quick:
        ns.steps, ns.kill_at, ns.interval, ns.per_group, ns.rounds = 12, 7, 4, 1, 1
    modes = ["replica groups", "restart-the-world"]
    results: dict[tuple[str, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = _prepared(Path(tmp) / "data")
        for r in range(ns.rounds):
            order = modes if r % 2 == 0 else modes[::-1]  # alternate: drift hits both alike
            for mode in order:
                for killed in (True,) if ns.quick else (False, True):  # quick: the kills only
                    dump = Path(tmp) / f"{mode.split()[0]}-{killed}-{r}"
                    results.setdefault((mode, killed), []).append(
                        _run(mode, killed, ns, dataset, dump)
                    )
    print(f"{ns.steps} steps, replica 1 killed before step {ns.kill_at}, checkpoint every "
          f"{ns.interval}, {ns.per_group} rank(s) per replica, {ns.rounds} round(s)")  # fmt: skip
    print("| mode | wall clean (s) | wall killed (s) | wall lost (s) | steps recomputed |")
    print("|---|---|---|---|---|")
    redone = {}
    for mode in modes:
        hit = statistics.median(x["wall"] for x in results[(mode, True)])
        redone[mode] = max(x["redone"] for x in results[(mode, True)])
        if (mode, False) in results:
            clean = statistics.median(x["wall"] for x in results[(mode, False)])
            walls = f"{clean:.1f} | {hit:.1f} | {hit - clean:+.1f}"
        else:
            walls = f"- | {hit:.1f} | -"
        print(f"| {mode} | {walls} | {redone[mode]} |")
    final_line(
        f"steps recomputed after the kill by replica groups (restart-the-world "
        f"{redone['restart-the-world']})",
        str(redone["replica groups"]),
        "<= 1",
    )


if __name__ == "__main__":
    main()
