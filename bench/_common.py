"""What every benchmark shares: the ``--quick`` flag and the one format of its last line.

The last line is ``<what>: <figure> (goal <op> <target>)``: the measured figure first, the goal
after it, so neither a reader nor a script (tests/test_bench.py) can take the goal for the result.
"""

from __future__ import annotations

import argparse

QUICK_HELP = (
    "tiny sizes, one round: checks that the benchmark runs end to end (CI runs this); "
    "its figures mean nothing"
)


def add_quick(parser: argparse.ArgumentParser) -> None:
    """Add ``--quick`` to a benchmark's parser."""
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)


def final_line(what: str, figure: str, goal: str) -> None:
    """Print the benchmark's last line: ``what: figure (goal ...)``."""
    if ":" in what or "(goal" in figure:
        raise ValueError("final_line: `what` takes no colon and `figure` no goal")
    print(f"{what}: {figure} (goal {goal})", flush=True)
