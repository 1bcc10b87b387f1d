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
import time
from collections.abc import Iterator

import psutil
import torch
from torch import nn

from titan_core.config.job import Profiling as ProfilingConfig
from titan_core.logging import logger

_MAX_SNAPSHOT_ENTRIES = 100_000


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

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        out = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(out, exist_ok=True)
        start = time.perf_counter()
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}_trace.json"))
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
        yield prof


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
        os.makedirs(out, exist_ok=True)
        if self.cuda:
            path = os.path.join(out, f"rank{self.rank}_memory_snapshot.pickle")
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
        else:
            path = os.path.join(out, f"rank{self.rank}_memory_report.json")
            with open(path, "w") as f:
                json.dump(self.cpu_report(step), f, indent=2)
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
