"""Engine tokens/s against a minimal plain-PyTorch loop: same model, shapes and optimizer.

Rounds pair engine and plain in one process (alternating which goes first) so machine drift hits
both alike; each reports the median of its 10-step windows after warm-up. The last line is the
ratio (goal >= 0.97).

    .venv/bin/python bench/engine_cpu.py [--rounds 8] [--steps 30] [--flavor debugmodel]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from titan_core.config.manager import parse_args
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.models import get_model_spec
from titan_core.trainer import Trainer, build_model_args

WINDOW = 10


def engine_round(flavor: str, steps: int, batch: int, seq: int, out: str) -> list[float]:
    """Tokens/s of each 10-step window of a real engine run (after its first window)."""
    cfg = parse_args(
        [
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
            "--model.flavor",
            flavor,
            "--training.steps",
            str(steps),
            "--training.local_batch_size",
            str(batch),
            "--training.seq_len",
            str(seq),
            "--metrics.log_freq",
            str(WINDOW),
            "--metrics.cpu_peak_tflops",
            "1",
            "--metrics.no_enable_jsonl",
            "--checkpoint.no_enable",
            "--validation.no_enable",
            "--job.dump_folder",
            out,
            "--job.no_save_config",
        ]
    )
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    windows = [h["tps"] for h in history if h["step"] % WINDOW == 0]
    return windows[1:]  # the first window holds warm-up


def plain_round(flavor: str, steps: int, batch: int, seq: int) -> list[float]:
    """Tokens/s of each 10-step window of the smallest loop that trains the same model."""
    cfg = parse_args(
        [
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
            "--model.flavor",
            flavor,
            "--training.seq_len",
            str(seq),
        ]
    )
    args = build_model_args(cfg, Tokenizer(str(default_tokenizer_path())).n_words)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_model_spec("llama3").model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    o = cfg.optimizer
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        foreach=True,
    )
    data = torch.randint(0, args.vocab_size, (steps, batch, seq + 1))
    windows, t0 = [], time.perf_counter()
    for step in range(steps):
        inputs, labels = data[step, :, :-1], data[step, :, 1:]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
        opt.step()
        if (step + 1) % WINDOW == 0:
            now = time.perf_counter()
            windows.append(WINDOW * batch * seq / (now - t0))
            t0 = now
    return windows[1:]


def main() -> None:
    """Run alternating rounds and print a table, then the ratio on the last line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    engine, plain = [], []
    with tempfile.TemporaryDirectory() as out:
        for r in range(a.rounds):
            # Alternate which loop goes first, so neither always runs on a warmer (or hotter) CPU.
            order = ("engine", "plain") if r % 2 == 0 else ("plain", "engine")
            for which in order:
                if which == "engine":
                    tps = engine_round(a.flavor, a.steps, a.batch, a.seq, out)
                    engine.append(statistics.median(tps))
                else:
                    plain.append(statistics.median(plain_round(a.flavor, a.steps, a.batch, a.seq)))
            print(
                f"round {r}: engine {engine[-1]:,.0f} tok/s   plain {plain[-1]:,.0f} tok/s   "
                f"ratio {engine[-1] / plain[-1]:.3f}"
            )
    # Each round pairs the two loops back to back, so the median of per-round ratios cancels
    # slow drift (thermal, other load) better than a ratio of overall medians.
    ratio = statistics.median(e / p for e, p in zip(engine, plain, strict=True))
    print(f"\n| loop   | tokens/s (median of {a.rounds} rounds) |")
    print("|--------|-------------|")
    print(f"| engine | {statistics.median(engine):11,.0f} |")
    print(f"| plain  | {statistics.median(plain):11,.0f} |")
    print(f"threads={torch.get_num_threads()} flavor={a.flavor} batch={a.batch} seq={a.seq}")
    print(f"ratio engine/plain (median of per-round ratios): {ratio:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
