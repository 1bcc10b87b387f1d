"""COMM_MODE debug modes: a whole world's job in ONE process.

    NGPU=128 COMM_MODE=fake_backend MODULE=llama3 CONFIG=llama3_70b ./run_train.sh
    NGPU=2 COMM_MODE=local_tensor ./run_train.sh --parallelism.tensor_parallel_degree 2

``fake_backend`` (a dry run): validates the config, builds the model and applies the whole
parallel plan for ``comm.fake_world_size`` ranks on fake process groups, materializes rank 0's
shards as fake tensors (no storage) and runs one training step on them; prints the plan, the
per-rank memory estimate (``titan_core.estimate``) and what the step held. Nothing is written:
DCP cannot save (or load) on fake process groups.

``local_tensor``: every rank's tensors live in this process (``LocalTensorMode``) and collectives
compute their real result, so losses equal a real multi-process run's. Runs TP layouts; FSDP2,
DDP, CP (sharded by FSDP2) and PP (a different program per stage) are refused with one line.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.config.job import JobConfig
from titan_core.distributed import simulation
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.distributed.plan_report import ModuleRow, mesh_lines, module_rows
from titan_core.errors import ConfigError, TitanError
from titan_core.logging import logger

if TYPE_CHECKING:  # the estimator is imported when a dry run starts
    from titan_core.estimate import Estimate
    from titan_core.estimate.memory import MemoryEstimate

_GIB = 2**30


@dataclass(frozen=True)
class StepResult:
    """What rank 0 held after the fake step: counts and bytes of its local shards."""

    loss: str
    num_params: int
    params_with_grad: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """AdamW state: exp_avg, exp_avg_sq and the step counters."""


@dataclass(frozen=True)
class DryRunReport:
    """Everything a fake_backend dry run found out."""

    world_size: int
    mesh: list[str]
    modules: list[ModuleRow]
    estimate: Estimate | None
    """The memory/FLOPs estimate of this config, or None when it could not be made."""
    step: StepResult
    notes: list[str]
    build_seconds: float
    step_seconds: float
    peak_rss_bytes: int


def check(cfg: JobConfig) -> ParallelDims:
    """Validate a COMM_MODE job before anything starts: degrees against the simulated world,
    and what local_tensor cannot simulate (one ConfigError line)."""
    dims = ParallelDims.from_config(cfg.parallelism, cfg.comm.fake_world_size)
    if cfg.comm.mode != "local_tensor":
        return dims
    refusals = (
        (dims.pp, "pipeline_parallel_degree", "pipeline parallelism runs a different program "
         "on each stage (MPMD), and LocalTensorMode simulates SPMD ranks only"),
        (dims.cp, "context_parallel_degree", "context parallelism shards parameters with FSDP2 "
         "over dp_shard x cp, and fully_shard fails under LocalTensorMode"),
        (dims.dp_shard, "data_parallel_shard_degree", "FSDP2's fully_shard fails under "
         "LocalTensorMode (it resizes parameter storage in place)"),
        (dims.dp_replicate, "data_parallel_replicate_degree", "replicate (DDP) fails under "
         "LocalTensorMode and one process feeds a single data stream"),
    )  # fmt: skip
    for degree, key, why in refusals:
        if degree > 1:
            raise ConfigError(
                f"comm.mode: local_tensor cannot simulate parallelism.{key}={degree}: {why}; "
                "set it to 1, or check that plan with comm.mode=fake_backend"
            )
    return dims


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Entry for ``train.run`` when ``comm.mode`` is not default: the dry run (no history), or
    the local_tensor training run (its logged metrics)."""
    if cfg.comm.mode == "fake_backend":
        print_report(dry_run(cfg))
        return []
    return run_local_tensor(cfg)


def run_local_tensor(cfg: JobConfig) -> list[dict[str, float]]:
    """Train ``cfg`` with every rank simulated in this process; saving is off (model weights
    load from the seed/step checkpoint without collectives)."""
    check(cfg)
    from titan_core.trainer import Trainer  # the trainer imports simulation, not this module

    if cfg.checkpoint.enable and not cfg.checkpoint.load_only:
        logger.info("comm.mode=local_tensor: checkpoint saving is off (loading still works)")
        cfg = dataclasses.replace(
            cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load_only=True)
        )
    with simulation.simulated_world("local_tensor", cfg.comm.fake_world_size):
        trainer = Trainer(cfg)
        try:
            trainer.checkpointer.reader = local_tensor_reader(trainer.model)
            return trainer.train()
        finally:
            trainer.close()


def _dry_run_config(cfg: JobConfig) -> tuple[JobConfig, list[str]]:
    """The config the dry run builds, and what it changed: the real vocabulary of a published
    flavor (the bundled tokenizer is tiny), no checkpoint I/O, no validation."""
    from titan_core.estimate.layout import resolve_vocab

    notes = []
    vocab, source = resolve_vocab(cfg)
    if cfg.model.vocab_size <= 0 and source == "flavor":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
        notes.append(f"model.vocab_size: the {cfg.model.flavor} flavor's {vocab:,} tokens")
    if cfg.checkpoint.enable:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, enable=False))
        notes.append("checkpoint: skipped (DCP cannot save or load on fake process groups)")
    if cfg.compile.enable and cfg.compile.backend not in ("eager", "aot_eager"):
        compile_cfg = dataclasses.replace(cfg.compile, backend="aot_eager")
        cfg = dataclasses.replace(cfg, compile=compile_cfg)
        notes.append(
            "compile: traced with backend aot_eager (fullgraph checked; generated kernels "
            "cannot run on fake tensors)"
        )
    if cfg.validation.enable:
        cfg = dataclasses.replace(cfg, validation=dataclasses.replace(cfg.validation, enable=False))
        notes.append("validation: skipped (the dry run runs one training step only)")
    return cfg, notes


def dry_run(cfg: JobConfig) -> DryRunReport:
    """Build and step ``cfg`` for ``comm.fake_world_size`` ranks on fake process groups and
    fake tensors; returns what was found (``print_report`` prints it)."""
    from titan_core.estimate import estimate
    from titan_core.estimate.fake_moe import balanced_routing
    from titan_core.trainer import Trainer

    world = cfg.comm.fake_world_size
    check(cfg)
    cfg, notes = _dry_run_config(cfg)
    try:
        est = estimate(cfg, world)
    except TitanError as e:  # the trainer below reports a bad config on its own
        est, notes = None, [*notes, f"memory estimate unavailable: {e}"]
    start = time.perf_counter()
    with simulation.simulated_world("fake_backend", world) as sim:
        trainer = Trainer(cfg)
        try:
            built = time.perf_counter()
            stage_ids = (
                [s.stage_index for s in trainer.pipeline.stages] if trainer.pipeline else None
            )
            mesh = mesh_lines(trainer.parallel_dims, world, trainer.pipeline)
            modules = module_rows(trainer.model_parts, stage_ids)
            data = iter(trainer.dataloader)
            # The batch becomes fake too: CP shards its buffers in place.
            batches = [
                tuple(sim.fake_mode.from_tensor(t) for t in next(data))
                for _ in range(cfg.training.gradient_accumulation_steps)
            ]
            if trainer.pipeline is not None:
                trainer.pipeline = _LocalStages(trainer.pipeline)
                notes.append(_LocalStages.NOTE)
            # MoE layers route on fake tensors as if balanced (routing is data).
            with sim.fake_mode, balanced_routing(trainer.model):
                loss, _ = trainer.train_step(batches)
            step = _step_result(trainer, loss)
            done = time.perf_counter()
        finally:
            trainer.close()
    return DryRunReport(
        world_size=world,
        mesh=mesh,
        modules=modules,
        estimate=est,
        step=step,
        notes=notes,
        build_seconds=built - start,
        step_seconds=done - built,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


class _LocalStages:
    """Stands in for ``PipelineRunner`` in the dry run: a schedule's first step exchanges
    stage metadata point to point, which fake process groups cannot answer, so one microbatch
    runs forward and backward through each of this rank's stages directly (a stage fed by a
    peer gets a fake activation shaped like the first stage's output)."""

    NOTE = (
        "pipeline: one microbatch ran forward+backward through this rank's stages directly "
        "(the schedule's point-to-point metadata exchange needs real peers)"
    )

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.stages = runner.stages
        self.num_microbatches = runner.num_microbatches

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        """Forward and backward of the first microbatch through the local stages; its loss
        times ``scale`` when this rank holds the last stage, else zero."""
        n = self.num_microbatches
        tokens, target = inputs.chunk(n)[0], labels.chunk(n)[0]
        loss = torch.zeros((), device=inputs.device)
        hidden: torch.Tensor | None = None  # (mb, seq, dim): what flows between stages
        for stage in sorted(self.stages, key=lambda s: s.stage_index):
            if stage.is_first:
                out = stage.submod(tokens)
            else:
                assert hidden is not None, "rank 0 always holds the first stage"
                out = stage.submod(torch.empty_like(hidden).requires_grad_())
            if hidden is None:
                hidden = out.detach()
            if stage.is_last:
                loss = self.runner.loss.loss_fn(out, target) * (scale / n)
                loss.backward()
            else:
                out.backward(torch.ones_like(out))
        return loss.detach()


def _held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this rank holds for ``tensors``: the storages of their local shards, each counted
    once (FSDP2 pads shards, and its gradients are views of one reduce-scatter buffer)."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def _step_result(trainer: Any, loss: torch.Tensor) -> StepResult:
    params = [p for part in trainer.model_parts for p in part.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    states = [
        v
        for p in params
        for v in trainer.optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return StepResult(
        loss=f"{str(local.dtype).removeprefix('torch.')} {list(local.shape)} (fake: no value)",
        num_params=len(params),
        params_with_grad=len(grads),
        param_bytes=_held_bytes(params),
        grad_bytes=_held_bytes(grads),
        optimizer_bytes=_held_bytes(states),
    )


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def rank0_estimate(est: Estimate) -> MemoryEstimate:
    """The memory estimate of the pipeline rank this process played (0), to compare with the
    fake step (the printed table shows the fullest pipeline rank)."""
    from titan_core.estimate.memory import estimate_rank_memory

    return estimate_rank_memory(est.layout, est.profiles, 0)


def print_report(report: DryRunReport) -> None:
    """Print the plan, the memory estimate and the step's result to stdout."""
    from titan_core.estimate.report import print_report as print_estimate

    console = Console(width=max(120, Console().width))
    say = lambda text: console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
    say(f"[bold]COMM_MODE=fake_backend dry run: {report.world_size} ranks in one process[/bold]")
    for line in report.mesh:
        say(line)
    say("Parallel plan on rank 0 (parameters: global shape → local shard, placement@mesh dim):")
    header = ModuleRow("module", "applied", "parameters")
    rows = [header, *report.modules]
    name_w = max(len(r.name) for r in rows)
    applied_w = max(len(r.applied) for r in rows)
    for row in rows:  # plain aligned text: greppable, never folded
        print(f"{row.name:<{name_w}}  {row.applied:<{applied_w}}  {row.params}".rstrip())
    if report.estimate is not None:
        print_estimate(report.estimate)
    s, est = report.step, report.estimate
    rank0 = rank0_estimate(est) if est is not None else None
    held = (("parameters", s.param_bytes, "params"), ("gradients", s.grad_bytes, "grads"))
    held += (("optimizer state", s.optimizer_bytes, "optimizer"),)
    parts = []
    for name, value, key in held:
        expected = f" (estimate {_size(getattr(rank0, key))})" if rank0 else ""
        parts.append(f"{name} {_size(value)}{expected}")
    say(
        f"one training step on fake tensors: loss {s.loss}; gradients on "
        f"{s.params_with_grad}/{s.num_params} parameters; rank 0 holds {', '.join(parts)}"
    )
    for note in report.notes:
        say(f"note: {note}")
    say(
        f"dry run OK: built in {report.build_seconds:.1f}s, stepped in {report.step_seconds:.1f}s,"
        f" peak RSS of this process {report.peak_rss_bytes / _GIB:.2f} GiB"
    )


def local_tensor_reader(model: torch.nn.Module) -> Callable[[dict[str, Any], str], None]:
    """A checkpoint reader for local_tensor runs: DCP's load gathers plans over the process
    group, which LocalTensorMode cannot simulate, so read the full weights without collectives
    and give each simulated rank its shard. Model weights only."""

    def read(states: dict[str, Any], path: str) -> None:
        sim = simulation.active()
        assert sim is not None and sim.local_mode is not None, "not in a local_tensor run"
        skipped = sorted(k for k in states if k != "model")
        if skipped:
            logger.warning(
                "comm.mode=local_tensor loads model weights only from %s; %s start fresh",
                path,
                ", ".join(skipped),
            )
        sharded = get_model_state_dict(model)
        with sim.local_mode.disable():
            full = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in sharded.items()}
            dcp.load({"model": full}, storage_reader=dcp_reader(path), no_dist=True)
        with torch.no_grad():
            for key, target in sharded.items():
                value = full[key]
                if isinstance(target, DTensor):
                    # Each simulated rank cuts its own shard (no scatter: src_data_rank=None).
                    value = distribute_tensor(
                        value, target.device_mesh, target.placements, src_data_rank=None
                    )
                target.copy_(value)

    return read
