"""Engine tokens/s against a minimal plain-PyTorch loop: same model, shapes and optimizer.

Rounds pair engine and plain in one process (alternating which goes first) so machine drift hits
both alike. Each loop is timed per 10-step window after a warm-up window, on two clocks: wall time
(what a user sees) and process CPU time (robust to other load on a shared machine). The engine is
timed through a ``MetricsSink`` plugged into the real trainer, so it runs exactly as users run it.
The last line is the wall-clock ratio (goal >= 0.97).

    .venv/bin/python bench/engine_cpu.py [--rounds 8] [--steps 40] [--flavor debugmodel]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _common import add_quick, final_line

from titan_core.build import build_model_args
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.models import get_model_spec
from titan_core.resolve import parse_args
from titan_core.trainer import Trainer

WINDOW = 10


class WindowClock:
    """Tokens per wall-second and per CPU-second of each window between calls of ``tick``."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens = WINDOW * tokens_per_step
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def tick(self) -> None:
        """Close the current window (the first call only starts one)."""
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.wall.append(self.tokens / (now[0] - self._last[0]))
            self.cpu.append(self.tokens / (now[1] - self._last[1]))
        self._last = now

    # MetricsSink protocol: the trainer calls log() every log_freq (= WINDOW) steps.
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Tick on each window boundary."""
        if step % WINDOW == 0:
            self.tick()

    def close(self) -> None:
        """Nothing to release."""

    def medians(self) -> tuple[float, float]:
        """Median wall and CPU tokens/s, dropping the first (warm-up) window."""
        return statistics.median(self.wall[1:]), statistics.median(self.cpu[1:])


def engine_round(flavor: str, steps: int, batch: int, seq: int, out: str) -> tuple[float, float]:
    """A real engine run; median (wall, cpu) tokens/s of its windows after warm-up."""
    overrides = {
        "--model.flavor": flavor, "--training.steps": str(steps),
        "--training.local_batch_size": str(batch), "--training.seq_len": str(seq),
        "--metrics.log_freq": str(WINDOW), "--metrics.cpu_peak_tflops": "1",
        "--job.dump_folder": out,
    }  # fmt: skip
    flags = ["--metrics.no_enable_jsonl", "--checkpoint.no_enable", "--validation.no_enable",
             "--job.no_save_config"]  # fmt: skip
    argv = ["--module", "llama3", "--config", "llama3_debugmodel", *flags]
    cfg = parse_args(argv + [x for kv in overrides.items() for x in kv])
    clock = WindowClock(batch * seq)
    trainer = Trainer(cfg, extra_sinks=[clock])
    try:
        trainer.train()
    finally:
        trainer.close()
    return clock.medians()


def plain_round(flavor: str, steps: int, batch: int, seq: int) -> tuple[float, float]:
    """The smallest loop that trains the same model; median (wall, cpu) tokens/s."""
    cfg = parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                      "--model.flavor", flavor, "--training.seq_len", str(seq)])  # fmt: skip
    args = build_model_args(cfg, Tokenizer(str(default_tokenizer_path())).n_words)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_model_spec("llama3").model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)  # fmt: skip
    data = torch.randint(0, args.vocab_size, (steps, batch, seq + 1))
    clock = WindowClock(batch * seq)
    clock.tick()
    for step in range(steps):
        inputs, labels = data[step, :, :-1], data[step, :, 1:]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
        opt.step()
        if (step + 1) % WINDOW == 0:
            clock.tick()
    return clock.medians()


def main() -> None:
    """Run paired rounds and print a table; the ratio is on the last line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    add_quick(p)
    a = p.parse_args()
    if a.quick:  # three windows: one warm-up, two timed (the engine's first tick only starts one)
        a.rounds, a.steps, a.flavor, a.batch, a.seq = 1, 3 * WINDOW, "debugmodel_tiny", 2, 64
    engine: list[tuple[float, float]] = []
    plain: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(a.rounds):
            # Alternate which loop goes first, so neither always runs on a warmer (or hotter) CPU.
            for which in ("engine", "plain") if r % 2 == 0 else ("plain", "engine"):
                if which == "engine":
                    engine.append(engine_round(a.flavor, a.steps, a.batch, a.seq, out))
                else:
                    plain.append(plain_round(a.flavor, a.steps, a.batch, a.seq))
            print(f"round {r}: wall engine {engine[-1][0]:,.0f} / plain {plain[-1][0]:,.0f} tok/s"
                  f" = {engine[-1][0] / plain[-1][0]:.3f};  cpu-time ratio "
                  f"{engine[-1][1] / plain[-1][1]:.3f}")  # fmt: skip
    # Per-round ratios pair the loops back to back: their median cancels slow drift.
    wall = statistics.median(e[0] / q[0] for e, q in zip(engine, plain, strict=True))
    cpu = statistics.median(e[1] / q[1] for e, q in zip(engine, plain, strict=True))
    print(f"\n| loop   | wall tok/s | cpu-time tok/s |   (medians of {a.rounds} rounds)")
    print("|--------|-----------:|---------------:|")
    for name, rows in (("engine", engine), ("plain", plain)):
        w, c = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"| {name:6} | {w:10,.0f} | {c:14,.0f} |")
    print(f"threads={torch.get_num_threads()} flavor={a.flavor} batch={a.batch} seq={a.seq}")
    print(f"cpu-time ratio engine/plain: {cpu:.3f}")
    final_line("ratio engine/plain (wall, median of per-round ratios)", f"{wall:.3f}", ">= 0.97")


if __name__ == "__main__":
    main()
