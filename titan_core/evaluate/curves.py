"""A run's in-loop evaluation curves as one PNG, from its ``metrics.jsonl``: a panel per metric
(``loss``, ``bits_per_byte``, ``acc`` by default), a line per evaluator that logs it
(``eval/<name>/<metric>``), the training loss beside the held-out losses.

    python -m titan_core.evaluate.curves outputs/demo/<run>/metrics.jsonl curves.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from titan_core import storage
from titan_core.config.metrics import direction

PANELS = ("loss", "bits_per_byte", "acc")
Curve = list[tuple[int, float]]


def read_curves(metrics_url: str) -> dict[str, Curve]:
    """``{name: [(step, value), ...]}`` of the training loss (``train/loss``) and every
    ``eval/<name>/<metric>`` in ``metrics.jsonl`` (timings aside), step ascending."""
    curves: dict[str, Curve] = {}
    for line in storage.read_text(metrics_url).splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key == "loss" or (key.startswith("eval/") and not key.endswith("/seconds")):
                name = "train/loss" if key == "loss" else key
                curves.setdefault(name, []).append((int(row["step"]), float(value)))
    return {k: sorted(v) for k, v in curves.items()}


def plot_eval_curves(
    metrics_url: str, path: str, panels: Sequence[str] = PANELS, title: str = ""
) -> str:
    """Write the PNG of ``read_curves(metrics_url)``, a panel per metric of ``panels`` that
    some evaluator logs (matplotlib, Agg backend, ~800 x 260 px); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves = read_curves(metrics_url)
    shown = [
        p for p in panels if any(k.startswith("eval/") and k.endswith(f"/{p}") for k in curves)
    ]
    if not shown:
        raise ValueError(f"{metrics_url}: no eval/<name>/<metric> of {', '.join(panels)}")
    fig, axes = plt.subplots(1, len(shown), figsize=(3.3 * len(shown), 3.2), dpi=80, squeeze=False)
    try:
        for ax, metric in zip(axes[0], shown, strict=True):
            for name, curve in curves.items():
                steps, values = zip(*curve, strict=True)
                if name == "train/loss" and metric == "loss":  # every logged step: a thin line
                    ax.plot(steps, values, color="0.6", linewidth=1, label="training")
                elif name.startswith("eval/") and name.endswith(f"/{metric}"):
                    ax.plot(steps, values, marker=".", label=name.split("/")[1])
            ax.set_title(f"{metric} ({direction(metric)} is better)", fontsize="medium")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        if title:
            fig.suptitle(title, fontsize="medium")
        fig.tight_layout()
        with storage.output_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m titan_core.evaluate.curves METRICS_JSONL PNG [--panels ...] [--title T]``."""
    parser = argparse.ArgumentParser(prog="python -m titan_core.evaluate.curves")
    parser.add_argument("metrics", help="a run's metrics.jsonl (any fsspec URL)")
    parser.add_argument("png", help="where the PNG goes")
    parser.add_argument("--panels", nargs="+", default=list(PANELS), help="metrics, a panel each")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args(argv)
    print(plot_eval_curves(args.metrics, args.png, args.panels, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
