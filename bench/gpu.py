"""Engine tokens/s, TFLOP/s, MFU and peak memory on one GPU, side by side with torchtitan.

Each run is a real ``titan train`` (``python -m titan_core.train``) in its own process: Llama 3
1B (and Qwen3 1.7B with ``--models llama3,qwen3``; a 4-layer cut of DeepSeek-V3's Moonlight-16B-A3B
shape, engine only, with ``deepseek_v3``), bf16 autocast, ``torch.compile``, AdamW
fused, the bundled corpus. Activation checkpointing is the cheapest setting the engine's own
memory estimate says fits the card (``--ac auto``: none, then selective, then full). torchtitan
(``bench/_torchtitan_run.py``) trains the same shapes, batch and settings in the same session;
engine and torchtitan alternate (E T, then T E) so drift hits both alike. Figures are medians
over log windows after warm-up.

MFU divides by the GPU's dense bf16 datasheet peak (the engine's table, ``metrics``); torchtitan's
own MFU uses its table, so both are recomputed here from tokens/s and the same FLOPs per token.

    python bench/gpu.py                      # on a GPU: Llama 3 1B, seq 4096, batch 2
    python bench/gpu.py --models llama3,qwen3 --rounds 2   # plus Qwen3 1.7B
    python bench/gpu.py --models deepseek_v3 # Moonlight-16B-A3B's layers, 4 of them, EP 1
    python bench/gpu.py --cpu-smoke          # the same code on a tiny model on CPU (= --quick)

The last line is the engine/torchtitan tokens/s ratio (goal >= 1.05), or, where torchtitan is
not installed, the engine's MFU (goal >= 50%).
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
from dataclasses import dataclass
from pathlib import Path

from _common import add_quick, final_line

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a GPU machine runs the checkout without installing it
    sys.path.insert(1, str(ROOT))
TORCHTITAN = Path(__file__).with_name("_torchtitan_run.py")
AC_ORDER = ("none", "selective", "full")
HEADROOM = 0.9  # of the card's memory: the estimate is a model, not a promise


@dataclass
class Shape:
    """One benchmarked model and its shapes."""

    family: str  # llama3 | qwen3 | deepseek_v3
    recipe: str  # engine registry recipe
    flavor: str  # flavor name, as both systems spell it
    seq: int
    batch: int
    steps: int
    log_freq: int
    compile: bool
    dtype: str = "bfloat16"
    vocab: int = -1  # the published vocabulary (torchtitan keeps it); -1: the tokenizer's
    overrides: tuple[str, ...] = ()  # engine config arguments on top of the recipe
    torchtitan: bool = True  # whether torchtitan has this exact shape to compare with
    label: str = ""  # the table's name of the shape; empty: the flavor

    @property
    def name(self) -> str:
        return self.label or self.flavor


@dataclass
class Result:
    """What one run measured."""

    system: str
    shape: Shape
    ac: str
    tps: float  # tokens/s per device, median of the windows after warm-up
    mem_gib: float  # peak reserved GPU memory (max RSS on CPU)
    seconds: float  # wall time of the whole run, start-up and compilation included
    note: str = ""


def _engine_argv(shape: Shape, ac: str, dump: str) -> list[str]:
    argv = ["--module", shape.family, "--config", shape.recipe]
    argv += ["--training.seq_len", str(shape.seq), "--training.local_batch_size", str(shape.batch)]
    argv += ["--training.steps", str(shape.steps), "--metrics.log_freq", str(shape.log_freq)]
    argv += ["--training.autocast_dtype", shape.dtype, "--activation_checkpoint.mode", ac]
    argv += ["--job.dump_folder", dump, "--checkpoint.no_enable", "--validation.no_enable"]
    argv += ["--job.no_save_config", "--lr_scheduler.warmup_steps", "2"]
    argv += ["--model.vocab_size", str(shape.vocab)]
    argv += ["--compile.enable" if shape.compile else "--compile.no_enable"]
    return [*argv, *shape.overrides]


def flops_per_token(shape: Shape, ac: str) -> float:
    """Training FLOPs per token of ``shape`` (6N + attention, as the engine's MFU counts them)."""
    import torch

    from titan_core.build import build_model_args
    from titan_core.data import Tokenizer, default_tokenizer_path
    from titan_core.models import get_model_spec
    from titan_core.resolve import parse_args

    cfg = parse_args(_engine_argv(shape, ac, tempfile.gettempdir()))
    args = build_model_args(cfg, Tokenizer(str(default_tokenizer_path())).n_words)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return float(spec.nparams_and_flops(args, model, shape.seq)[1])


def pick_ac(shape: Shape, device_gib: float) -> str:
    """The cheapest AC mode whose estimated peak fits ``HEADROOM`` of the device."""
    from titan_core.estimate import estimate
    from titan_core.resolve import parse_args

    for ac in AC_ORDER:
        cfg = parse_args(_engine_argv(shape, ac, tempfile.gettempdir()))
        peak = estimate(cfg, 1).memory.peak / 2**30
        print(f"  estimate: AC {ac}: peak {peak:.1f} GiB of {device_gib:.1f} GiB", flush=True)
        if peak <= HEADROOM * device_gib:
            return ac
    return AC_ORDER[-1]


def _after_warmup(values: list[float]) -> float:
    """Median of the windows after the first two (compilation and the first recompiles)."""
    tail = values[2:] or values[-1:]
    return statistics.median(tail) if tail else float("nan")


def run_engine(shape: Shape, ac: str, timeout: float) -> Result:
    """One ``titan train`` process; tokens/s and memory from its metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as dump:
        cmd = [sys.executable, "-m", "titan_core.train", *_engine_argv(shape, ac, dump)]
        start = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env()
        )
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-1500:]
            return Result("engine", shape, ac, float("nan"), float("nan"), seconds, tail)
        rows = [json.loads(line) for line in Path(dump, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tps" in r and r.get("step", 0) > 1]
    mem = max(r.get("memory/max_reserved_gib", r.get("memory/max_rss_gib", 0.0)) for r in rows)
    return Result("engine", shape, ac, _after_warmup([r["tps"] for r in rows]), mem, seconds)


KERNEL_KINDS = (  # (kind, name fragments), first match wins
    ("attention", ("cudnn", "flash", "fmha", "attention")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("fused (inductor)", ("triton",)),
)


def profile_engine(shape: Shape, ac: str, timeout: float) -> list[str]:
    """One engine run with torch's profiler on two steps; where the GPU time goes, as lines."""
    steps, freq = 25, 20
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as dump:
        argv = _engine_argv(Shape(**{**shape.__dict__, "steps": steps}), ac, dump)
        argv += ["--profiling.enable_profiling", "--profiling.profile_freq", str(freq)]
        argv += ["--profiling.profiler_active", "2", "--profiling.profiler_warmup", "3"]
        cmd = [sys.executable, "-m", "titan_core.train", *argv]
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env()
        )
        traces = sorted(Path(dump).glob("profile_traces/*/rank0_trace.json"))
        if proc.returncode != 0 or not traces:
            return [f"profile: run failed (rc {proc.returncode}): {proc.stderr[-500:]}"]
        return summarize_trace(json.loads(traces[-1].read_text()))


def summarize_trace(trace: dict) -> list[str]:
    """Step time, GPU idle share and the split of kernel time by kind, from a chrome trace.

    Steps are the host-side ``ProfilerStep#`` ranges (the trace also repeats them on the GPU
    timeline); under the profiler both run somewhat slower than without it."""
    events = trace.get("traceEvents", [])
    steps = [
        e
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") == "user_annotation"
    ]
    wall = sum(float(e.get("dur", 0)) for e in steps)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not wall or not kernels:
        return ["profile: no profiled steps or kernels in the trace"]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        name, us = str(e.get("name", "")), float(e.get("dur", 0))
        kind = "memcpy/memset" if e.get("cat") != "kernel" else "other"
        for k, fragments in KERNEL_KINDS:
            if e.get("cat") == "kernel" and any(f in name.lower() for f in fragments):
                kind = k
                break
        by_kind[kind] = by_kind.get(kind, 0.0) + us
        by_name[name[:70]] = by_name.get(name[:70], 0.0) + us
    busy = _union_us([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels])
    n, total = len(steps), sum(by_kind.values())
    idle = max(0.0, 1 - busy / wall)
    lines = [
        f"profile of {n} steps (under the profiler): {wall / 1e3 / n:.1f} ms/step, kernels "
        f"{total / 1e3 / n:.1f} ms/step, GPU idle {100 * idle:.1f}% of the step",
        "  share of kernel time by kind:",
    ]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {kind:<18} {100 * us / total:5.1f}%  {us / 1e3 / n:7.1f} ms/step")
    lines.append("  top kernels (share of kernel time):")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"    {100 * us / total:5.1f}%  {name}")
    return lines


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlapping streams counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def torchtitan_available() -> bool:
    """Whether torchtitan imports here (it is carried to the GPU machine, not a dependency)."""
    probe = [sys.executable, "-c", "import torchtitan"]
    return subprocess.run(probe, capture_output=True, env=_env()).returncode == 0


def run_torchtitan(shape: Shape, ac: str, timeout: float, cpu: bool) -> Result:
    """torchtitan's trainer on the same shapes (``_torchtitan_run.py`` prints one JSON line)."""
    cmd = [sys.executable, str(TORCHTITAN), "--model", shape.family, "--flavor", shape.flavor]
    cmd += ["--seq", str(shape.seq), "--batch", str(shape.batch), "--steps", str(shape.steps)]
    # The same steps left out as the engine's first two log windows (compilation, recompiles).
    cmd += ["--ac", ac, "--warmup", str(2 * shape.log_freq), "--timeout", str(int(timeout))]
    cmd += ["--compile" if shape.compile else "--no-compile"] + (["--cpu"] if cpu else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    except subprocess.TimeoutExpired:
        return Result("torchtitan", shape, ac, float("nan"), float("nan"), timeout, "timed out")
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return Result("torchtitan", shape, ac, float("nan"), float("nan"), seconds, tail)
    got = json.loads(lines[-1])
    note = f"torchtitan {got.get('version', '?')}" + (f"; {got['note']}" if got.get("note") else "")
    return Result("torchtitan", shape, ac, float(got["tps"]), float(got["mem_gib"]), seconds, note)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def device_facts() -> tuple[str, float, float]:
    """(device name, memory GiB, dense bf16 peak TFLOP/s the engine's MFU divides by)."""
    import torch

    from titan_core.components.metrics import device_peak_tflops
    from titan_core.config.job import Metrics

    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        name = torch.cuda.get_device_name(device)
    else:
        import psutil

        device, gib, name = torch.device("cpu"), psutil.virtual_memory().total / 2**30, "CPU"
    peak = device_peak_tflops(device, Metrics(), torch.bfloat16)
    return name, gib, peak.tflops


def print_table(results: list[Result], peak: float, fpt: dict[str, float]) -> None:
    """One row per run, then the medians per system and model."""
    head = f"{'system':<11} {'model':<22} {'seq':>5} {'bs':>3} {'AC':<9} {'tok/s':>10}"
    print(head + f" {'TFLOP/s':>8} {'MFU':>7} {'mem GiB':>8} {'run s':>6}  note")
    for r in results:
        tflops = r.tps * fpt[r.shape.name] / 1e12
        print(
            f"{r.system:<11} {r.shape.family + ' ' + r.shape.name:<22} {r.shape.seq:>5} "
            f"{r.shape.batch:>3} {r.ac:<9} {r.tps:>10,.0f} {tflops:>8.1f} "
            f"{100 * tflops / peak:>6.1f}% {r.mem_gib:>8.1f} {r.seconds:>6.0f}  "
            f"{r.note.splitlines()[-1][:90] if r.note else ''}",
            flush=True,
        )


def median_tps(results: list[Result], system: str, flavor: str) -> float:
    """Median tokens/s of ``system``'s runs of the shape named ``flavor`` (nan when none
    succeeded)."""
    got = [r.tps for r in results if r.system == system and r.shape.name == flavor]
    got = [t for t in got if t == t]
    return statistics.median(got) if got else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (= --quick)")
    add_quick(parser)
    parser.add_argument("--rounds", type=int, default=1, help="E-T / T-E pairs per model")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ac", default="auto", choices=["auto", *AC_ORDER])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--models",
        default="llama3",
        help="comma list: llama3 (1B), qwen3 (1.7B), deepseek_v3 (Moonlight-16B-A3B's shape cut "
        "to 4 layers, 2.5B parameters, 1.0B activated; EP 1; no torchtitan twin)",
    )
    parser.add_argument("--torchtitan-first", action="store_true", help="rounds start T E")
    parser.add_argument("--no-torchtitan", action="store_true")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="and where the GPU time goes")
    args = parser.parse_args()
    smoke = args.cpu_smoke or args.quick
    name, gib, peak = device_facts()
    if smoke:
        tiny = Shape("llama3", "llama3_debugmodel", "debugmodel", 128, 2, 8, 2, False, "float32")
        shapes = [tiny]
    else:
        compile_ = not args.no_compile
        run = (args.seq, args.batch, args.steps, 5, compile_)
        known = {
            "llama3": Shape("llama3", "llama3_1b", "1B", *run, vocab=128256),
            "qwen3": Shape("qwen3", "qwen3_1_7b", "1.7B", *run, vocab=151936),
            # Moonlight-16B-A3B's layers (MLA, 64 experts top-6 + 2 shared) on one GPU: 1 dense +
            # 3 MoE layers, experts unsharded (EP 1). ~58 GiB at seq 4096 x 2 without AC (the
            # estimate), so it fits an 80 GB H100; torchtitan has no 4-layer 16B to compare.
            "deepseek_v3": Shape(
                "deepseek_v3",
                "deepseek_v3_16b_a3b",
                "16B-A3B",
                *run,
                vocab=163840,
                overrides=("--model.n_layers", "4", "--parallelism.expert_parallel_degree", "1"),
                torchtitan=False,
                label="16B-A3B/4L",
            ),
        }
        shapes = [known[m.strip()] for m in args.models.split(",")]
    with_tt = not args.no_torchtitan and torchtitan_available()
    print(f"device: {name}, {gib:.1f} GiB, dense bf16 peak {peak:.1f} TFLOP/s", flush=True)
    if not with_tt:
        print("torchtitan: not run (not installed here, or --no-torchtitan)", flush=True)
    results: list[Result] = []
    fpt: dict[str, float] = {}
    for shape in shapes:
        ac = args.ac if args.ac != "auto" else pick_ac(shape, gib)
        fpt[shape.name] = flops_per_token(shape, ac)
        for i in range(max(1, args.rounds)):
            order = ["engine", "torchtitan"]
            if (i % 2 == 1) != args.torchtitan_first:
                order.reverse()
            for system in order:
                if system == "engine":
                    results.append(run_engine(shape, ac, args.timeout))
                elif with_tt and shape.torchtitan:
                    results.append(run_torchtitan(shape, ac, args.timeout, cpu=smoke))
                else:
                    continue
                print(f"  {results[-1].system} {shape.name}: {results[-1].tps:,.0f} tok/s",
                      flush=True)  # fmt: skip
    profile = profile_engine(shapes[0], ac, args.timeout) if args.profile else []
    print()
    print_table(results, peak, fpt)
    for line in profile:
        print(line)
    if args.json:
        rows = [{**r.__dict__, "shape": r.shape.__dict__} for r in results]
        args.json.write_text(json.dumps({"device": name, "peak": peak, "runs": rows}, indent=1))
    first = shapes[0].name
    engine = median_tps(results, "engine", first)
    if with_tt and shapes[0].torchtitan:
        ratio = engine / median_tps(results, "torchtitan", first)
        final_line(f"engine/torchtitan tokens/s, {shapes[0].family} {first}", f"{ratio:.3f}x",
                   ">= 1.05x")  # fmt: skip
    else:
        mfu = 100 * engine * fpt[first] / 1e12 / peak
        final_line(f"engine MFU, {shapes[0].family} {first}", f"{mfu:.1f}%", ">= 50%")
    return 0 if engine == engine else 1


if __name__ == "__main__":
    sys.exit(main())
