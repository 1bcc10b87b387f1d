"""Training metrics: throughput, FLOPs/MFU, memory, timing, and the sinks they are sent to.

``MetricsSink`` is the seam the pipeline plugs MLflow into; the engine ships console,
JSONL and TensorBoard sinks.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import psutil
import torch

from titan_core import storage
from titan_core.config.job import Metrics as MetricsConfig
from titan_core.logging import logger

# Dense bf16 peak TFLOP/s by device-name fragment (vendor datasheets, no sparsity).
_GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "A10G": 125.0,
    "L4": 121.0,
}


@runtime_checkable
class MetricsSink(Protocol):
    """Where per-step metrics go; implemented by console, JSONL, TensorBoard and MLflow sinks."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of one step."""

    def close(self) -> None:
        """Flush and release resources."""


class ConsoleSink:
    """One coloured line per logged step, torchtitan style."""

    def __init__(self, color: str = "auto") -> None:
        use = color == "always" or (color == "auto" and sys.stdout.isatty())
        codes = {"red": 31, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "cyan": 36}
        self.c = {k: (f"\033[{v}m" if use else "") for k, v in codes.items()}
        self.reset = "\033[0m" if use else ""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log the step's headline numbers on one line."""
        c, r = self.c, self.reset
        mem = metrics.get("memory/max_reserved_gib", metrics.get("memory/rss_gib", 0.0))
        mem_pct = metrics.get("memory/max_reserved_pct")
        mem_txt = f"{mem:.2f}GiB" + (f"({mem_pct:.1f}%)" if mem_pct is not None else "")
        logger.info(
            f"{c['red']}step: {step:>5}  {c['green']}loss: {metrics['loss']:8.4f}  "
            f"{c['yellow']}grad_norm: {metrics['grad_norm']:7.4f}  lr: {metrics['lr']:.2e}  "
            f"{c['cyan']}memory: {mem_txt}  {c['blue']}tps: {metrics['tps']:,.0f}  "
            f"tflops: {metrics['tflops']:.2f}  {c['magenta']}mfu: {metrics['mfu_pct']:.2f}%  "
            f"data: {metrics['data_pct']:.1f}%  step_s: {metrics['step_time_s']:.3f}{r}"
            + _moe_text(metrics)
        )

    def close(self) -> None:
        """Nothing to release."""


def _moe_text(metrics: dict[str, float]) -> str:
    """The MoE part of the console line: aux loss and the worst layer's max load (all the
    per-layer figures go to the other sinks), and the multi-token prediction loss."""
    parts = [f"mtp: {metrics['mtp/loss']:.4f}"] if "mtp/loss" in metrics else []
    if "moe/aux_loss" in metrics:
        parts.append(f"aux: {metrics['moe/aux_loss']:.4f}")
    if "moe/load_max" in metrics:
        parts.append(f"load_max: {metrics['moe/load_max']:.2f}")
    return ("  " + "  ".join(parts)) if parts else ""


class JsonlSink:
    """Appends ``{"step": N, ...metrics}`` lines to a local file (read by tests and tools); a
    full disk is one ``StorageError`` line naming it, and no half line stays."""

    def __init__(self, path: str) -> None:
        self._log = storage.LineLog(path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one JSON line."""
        self._log.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._log.close()


class TensorBoardSink:
    """Scalars to TensorBoard event files."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard writes its event files itself (a thread of its own): its storage errors
        # are turned into the one line here, as the writer reports them.
        self.log_dir = log_dir
        with storage.writing_errors(log_dir):
            self._writer = SummaryWriter(log_dir, max_queue=1000)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Add each metric as a scalar."""
        with storage.writing_errors(self.log_dir):
            for key, value in metrics.items():
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close the writer."""
        with storage.writing_errors(self.log_dir):
            self._writer.close()


class MemoryMonitor:
    """Peak memory since the last reset: CUDA allocator stats on GPU, process RSS on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> dict[str, float]:
        """Memory metrics in GiB (and % of device capacity on GPU)."""
        gib = 1024**3
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            active = stats.get("active_bytes.all.peak", 0)
            reserved = stats.get("reserved_bytes.all.peak", 0)
            return {
                "memory/max_active_gib": active / gib,
                "memory/max_reserved_gib": reserved / gib,
                "memory/max_reserved_pct": 100.0 * reserved / self.capacity,
                "memory/num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "memory/num_ooms": float(stats.get("num_ooms", 0)),
            }
        # ru_maxrss is KiB on Linux: the process-lifetime peak, the best CPU analogue of "max".
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "memory/rss_gib": psutil.Process().memory_info().rss / gib,
            "memory/max_rss_gib": peak / gib,
        }

    def reset_peak(self) -> None:
        """Start a new peak window (GPU only; RSS peak is process-lifetime)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


@dataclass(frozen=True)
class Peak:
    """The MFU denominator: peak TFLOP/s of the device this rank uses, and where it came from."""

    tflops: float
    source: str


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _cpu_ghz(info: dict[str, str]) -> float:
    """The highest clock the kernel reports (cpufreq's maximum), else the model name's
    (``@ 2.20GHz``), else the current ``cpu MHz``; 0.0 when none is known."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return int(f.read()) / 1e6
    except (OSError, ValueError):
        pass
    if m := re.search(r"@\s*([\d.]+)\s*GHz", info.get("model name", "")):
        return float(m.group(1))
    try:
        return float(info.get("cpu MHz", "0")) / 1e3
    except ValueError:
        return 0.0


def cpu_peak_tflops(dtype: torch.dtype, threads: int, info: dict[str, str] | None = None) -> Peak:
    """The theoretical peak of ``threads`` cores of this CPU for ``dtype``: cores x clock x
    FLOPs per cycle per core, from the instruction sets it reports. Two FMA pipes of the widest
    vector width: an upper bound, so that MFU cannot pass 100% (AMD before Zen 5 runs AVX-512 on
    256-bit pipes and is counted so; bf16 counts AVX512-BF16's two products per lane, or AMX)."""
    info = _cpuinfo() if info is None else info
    flags = set(info.get("flags", "").split())
    amd_256 = info.get("vendor_id") == "AuthenticAMD" and int(info.get("cpu family", "0")) < 26
    bits = 512 if "avx512f" in flags and not amd_256 else 256 if "avx" in flags else 128
    per_cycle = bits // 32 * (4 if "fma" in flags else 2)  # fp32: lanes x 2 pipes x (mul+add)
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    if dtype in (torch.bfloat16, torch.float16) and "amx_bf16" in flags:
        per_cycle, isa = 1024, "amx"
    elif dtype == torch.bfloat16 and "avx512_bf16" in flags:
        per_cycle, isa = per_cycle * 2, "avx512_bf16"
    elif dtype == torch.float64:
        per_cycle //= 2
    ghz = _cpu_ghz(info)
    cores = max(1, min(threads, len(os.sched_getaffinity(0))))
    plural = "s" if cores > 1 else ""
    source = (
        f"{cores} core{plural} x {ghz:.2f} GHz x {per_cycle} FLOP/cycle ({isa}, {_short(dtype)})"
    )
    return Peak(cores * ghz * 1e9 * per_cycle / 1e12, source)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_peak_tflops(device: torch.device, cfg: MetricsConfig, dtype: torch.dtype) -> Peak:
    """Peak TFLOP/s used as the MFU denominator: the config's value, the GPU's datasheet (dense
    bf16), or the CPU's theoretical peak for the cores this rank uses."""
    if device.type == "cuda":
        if cfg.device_peak_tflops > 0:
            return Peak(cfg.device_peak_tflops, "metrics.device_peak_tflops")
        name = torch.cuda.get_device_name(device)
        for fragment, peak in _GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return Peak(peak, f"{fragment} datasheet, dense bf16")
        logger.warning(
            "Unknown GPU %r: MFU uses the H100 peak; set metrics.device_peak_tflops", name
        )
        return Peak(_GPU_PEAK_TFLOPS["H100"], f"unknown GPU {name!r}: the H100's")
    if cfg.cpu_peak_tflops > 0:
        return Peak(cfg.cpu_peak_tflops, "metrics.cpu_peak_tflops")
    return cpu_peak_tflops(dtype, torch.get_num_threads())


@dataclass
class MetricsProcessor:
    """Accumulates per-step timings/tokens and emits a metrics dict to every sink each log_freq."""

    cfg: MetricsConfig
    flops_per_token: int
    peak_tflops: float
    memory: MemoryMonitor
    sinks: list[MetricsSink] = field(default_factory=list)
    peak_source: str = ""  # where peak_tflops came from, for the warning of an MFU above 100%
    _warned: bool = False
    _tokens: int = 0
    _data_s: float = 0.0
    _steps: int = 0
    _t0: float = field(default_factory=time.perf_counter)

    def add_data_time(self, seconds: float) -> None:
        """Account time spent waiting for the dataloader."""
        self._data_s += seconds

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` spent outside training (in-loop evaluation) out of the window's
        rates: tps, MFU and step time count training only."""
        self._t0 += seconds

    def add_step(self, num_tokens: float) -> None:
        """Account one finished optimizer step of ``num_tokens`` tokens on this rank."""
        self._tokens += num_tokens
        self._steps += 1

    def should_log(self, step: int) -> bool:
        """Log on the first step and every log_freq steps."""
        return step == 1 or step % self.cfg.log_freq == 0

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Compute the window's rates, send them to every sink, and reset the window."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        tps = self._tokens / elapsed
        tflops = self.flops_per_token * tps / 1e12
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "mfu_pct": 100.0 * tflops / self.peak_tflops if self.peak_tflops else 0.0,
            "data_pct": 100.0 * self._data_s / elapsed,
            "step_time_s": elapsed / max(self._steps, 1),
            **self.memory.read(),
            **(extra or {}),
        }
        if metrics["mfu_pct"] > 100 and not self._warned:
            self._warned = True
            logger.warning(
                "mfu %.1f%% is above 100%%: the peak it divides by (%.4g TFLOP/s: %s) is too low "
                "for this device; set metrics.cpu_peak_tflops or metrics.device_peak_tflops",
                metrics["mfu_pct"],
                self.peak_tflops,
                self.peak_source or "given",
            )
        for sink in self.sinks:
            sink.log(step, metrics)
        self._tokens, self._data_s, self._steps = 0, 0.0, 0
        self.memory.reset_peak()
        self._t0 = time.perf_counter()
        return metrics

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        """Send out-of-band scalars (e.g. validation loss) to the non-console sinks."""
        for sink in self.sinks:
            if not isinstance(sink, ConsoleSink):
                sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink."""
        for sink in self.sinks:
            sink.close()
