"""torch profiler traces and memory snapshots, written under the job's dump folder.

On GPU, memory snapshots are the CUDA allocator history pickles that pytorch.org/memory_viz opens.
The CPU build has no such API, so on CPU a JSON memory report is written instead (said once).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import resource
import shutil
import time
from collections.abc import Iterator

import psutil
import torch
from torch import nn

from titan_core import storage
from titan_core.config.job import Profiling as ProfilingConfig
from titan_core.errors import StorageError
from titan_core.logging import logger

_MAX_SNAPSHOT_ENTRIES = 100_000


def _check_trace(tmp: str, path: str) -> None:
    """Kineto's trace writer (C++) ignores a failed write (a full disk): what it wrote must be
    a whole JSON document, else the trace is refused in one line rather than kept cut short."""
    size = os.path.getsize(tmp)
    with open(tmp, "rb") as f:
        f.seek(max(size - 64, 0))
        whole = f.read().rstrip().endswith((b"}", b"]"))
    if not whole:
        free = shutil.disk_usage(os.path.dirname(tmp)).free
        why = "no space left on device" if free < (1 << 20) else f"cut short ({size} bytes)"
        raise StorageError(f"{path}: {why}")


@contextlib.contextmanager
def maybe_enable_profiling(
    cfg: ProfilingConfig, dump_folder: str, rank: int, start_step: int
) -> Iterator[torch.profiler.profile | None]:
    """Yield a running profiler (call ``.step()`` each step) that exports a trace every
    ``profile_freq`` steps to ``<dump>/<traces>/iteration_N/rank{r}_trace.json``; else None."""
    if not cfg.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(dump_folder, cfg.save_traces_folder)
    failed: list[StorageError] = []

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        # An error raised in here leaves the profiler half-way (a crash when it stops): it is
        # kept, and raised by the next step() once the profiler is done with the callback.
        if failed:
            return
        out = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        start = time.perf_counter()
        path = os.path.join(out, f"rank{rank}_trace.json")
        try:
            with storage.output_path(path) as tmp:
                prof.export_chrome_trace(tmp)
                _check_trace(tmp, path)
        except StorageError as e:
            failed.append(e)
            return
        logger.info("Profiler trace written to %s in %.2fs", out, time.perf_counter() - start)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    active, warmup = cfg.profiler_active, cfg.profiler_warmup
    wait = max(cfg.profile_freq - active - warmup, 0)
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    ) as prof:
        # Align the profiler's step counter with training steps so folder names match.
        prof.step_num = start_step
        yield _Profiler(prof, failed)
    if failed:
        raise failed[0]


class _Profiler:
    """``torch.profiler.profile`` whose ``step()`` raises a trace that could not be written."""

    def __init__(self, prof: torch.profiler.profile, failed: list[StorageError]) -> None:
        self._prof, self._failed = prof, failed

    def step(self) -> None:
        """Advance the profiler's schedule (exporting a trace when one is due)."""
        self._prof.step()
        if self._failed:
            raise self._failed[0]

    def __getattr__(self, name: str) -> object:
        return getattr(self._prof, name)


class MemoryProfiler:
    """Writes a memory snapshot every ``profile_freq`` steps, and one on OOM (``_exit``)."""

    def __init__(
        self,
        cfg: ProfilingConfig,
        dump_folder: str,
        rank: int,
        device: torch.device,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.cuda = device.type == "cuda"
        self.model = model
        self.optimizer = optimizer
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=_MAX_SNAPSHOT_ENTRIES)
        else:
            logger.info(
                "CUDA memory snapshots are unavailable on CPU: writing CPU memory reports "
                "(rank%d_memory_report.json) to %s instead",
                rank,
                self.folder,
            )

    def step(self, step: int, exit_: bool = False) -> None:
        """Dump when ``step`` is a multiple of profile_freq (always when ``exit_``)."""
        if not exit_ and step % self.cfg.profile_freq:
            return
        out = os.path.join(self.folder, f"iteration_{step}" + ("_exit" if exit_ else ""))
        if self.cuda:  # the format of torch's memory viz (written, never read back here)
            path = os.path.join(out, f"rank{self.rank}_memory_snapshot.pickle")
            storage.write_bytes(path, pickle.dumps(torch.cuda.memory._snapshot()))
        else:
            path = os.path.join(out, f"rank{self.rank}_memory_report.json")
            storage.write_text(path, json.dumps(self.cpu_report(step), indent=2))
        logger.info("Memory snapshot written to %s", path)

    def cpu_report(self, step: int) -> dict[str, object]:
        """Process RSS and the bytes held by parameters, gradients and optimizer state."""

        def nbytes(tensors: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        opt_state = [
            v
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        mib = 1024**2
        return {
            "step": step,
            "kind": "cpu_memory_report",
            "note": "CUDA memory snapshots are unavailable on CPU; this report replaces them",
            "rss_mib": psutil.Process().memory_info().rss / mib,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "parameters_mib": nbytes(params) / mib,
            "gradients_mib": nbytes(grads) / mib,
            "optimizer_state_mib": nbytes(opt_state) / mib,
            "python_gc_objects": len(gc.get_objects()),
        }

    def close(self) -> None:
        """Stop recording allocator history."""
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
