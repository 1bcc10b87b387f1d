"""The trainer: builds every component from a ``JobConfig``, then runs the step loop.

It stays small by delegating: data (``data``), model + parallelism (``models``/``distributed``),
optimizer/schedule/metrics/profiling/validation (``components``), state (``checkpoint``).
Everything that can reject bad input runs before anything is written.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan_core import storage
from titan_core.build import build_model_parts, check_job, local_side_folder, resolved_config
from titan_core.checkpoint.manager import (
    CheckpointManager,
    complete_steps,
    newest_healthy,
    read_marker,
)
from titan_core.checkpoint.states import ModelState, TrainState
from titan_core.components.evaluators import Evaluators, build_evaluators
from titan_core.components.health import (
    HealthGuard,
    HealthStop,
    Incident,
    arm_bitflip,
    grad_fingerprint,
    inject_faults,
    recompute_verdict,
)
from titan_core.components.loss import cross_entropy_loss
from titan_core.components.lr_scheduler import LRSchedulerState, build_lr_scheduler
from titan_core.components.metrics import (
    ConsoleSink,
    JsonlSink,
    MemoryMonitor,
    MetricsProcessor,
    MetricsSink,
    TensorBoardSink,
    device_peak_tflops,
)
from titan_core.components.mlflow_sink import mlflow_sink_from_env
from titan_core.components.moe_stats import MoEStats
from titan_core.components.mtp_stats import MTPStats
from titan_core.components.optimizer import OptimizerState, build_optimizer
from titan_core.components.profiling import MemoryProfiler, maybe_enable_profiling
from titan_core.components.stragglers import StragglerMonitor, slow_down
from titan_core.components.validate import Validator, validation_data, validation_dataloader
from titan_core.config.dtypes import autocast_dtype, compute_dtype
from titan_core.config.job import Dataloader, JobConfig, parse_injections
from titan_core.config.schema import to_toml
from titan_core.data import PreparedDataloader, build_dataloader
from titan_core.distributed import fault_tolerance, flight_recorder
from titan_core.distributed import utils as dist_utils
from titan_core.distributed.context_parallel import context_parallel_context, model_cp_buffers
from titan_core.distributed.pipeline_parallel import ModelPartsView
from titan_core.logging import init_logger, logger
from titan_core.models import describe_model, get_model_spec, labels_ahead_depth
from titan_core.models.common.mtp import labels_ahead
from titan_core.stop_request import StopRequests


class Trainer:
    """Single entry for one training job on this process (one rank under torchrun)."""

    def __init__(self, cfg: JobConfig, extra_sinks: list[MetricsSink] | None = None) -> None:
        init_logger()
        # Fault tolerance: this process is one rank of one replica group, which runs the job
        # as a single replica would (the replicate dimension is torchft's, across groups).
        self.job_cfg, ft = cfg, cfg.fault_tolerance
        self.cfg = cfg = fault_tolerance.group_config(cfg)
        self.side_folder = local_side_folder(cfg.job.dump_folder)
        if ft.enable and ft.group_id > 0:  # group 0 writes where a job would; the others beside
            self.side_folder = os.path.join(self.side_folder, f"group-{ft.group_id}")
        if cfg.debug.num_threads:
            torch.set_num_threads(cfg.debug.num_threads)
        # Everything that validates input comes first: nothing is written before it passes.
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.parallel_dims, self.tokenizer, self.model_args = check_job(cfg, world_size)
        spec = get_model_spec(cfg.model.name)
        self.dist = dist_utils.init_distributed(
            cfg.comm.init_timeout_seconds,
            cfg.comm.trace_buf_size,
            self.side_folder,
        )
        self.device = self.dist.device
        if self.dist.world_size > 1:
            self.parallel_dims.build_mesh(self.device.type)  # sub-groups: torch's 30 min default
            flight_recorder.set_group_timeouts(cfg.comm.init_timeout_seconds)
        dp_rank = self.parallel_dims.dp_rank(self.dist.rank)
        self._finite_loaders: dict[tuple, PreparedDataloader] = {}  # validation, built once
        # Replica groups read one global order: group g the data-parallel ranks g * dp + d.
        groups = self.job_cfg.parallelism.data_parallel_replicate_degree if ft.enable else 1
        dp = self.parallel_dims.dp_degree
        self.dataloader = self._build_loader(
            cfg.dataloader, max(ft.group_id, 0) * dp + dp_rank, True, dp_world=groups * dp
        )
        self.validator = self._build_validator(dp_rank)

        pp_rank = self.parallel_dims.mesh["pp"].get_local_rank() if self.parallel_dims.pp > 1 else 0
        dist_utils.set_determinism(  # a different seed per pipeline stage, as torchtitan does
            cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only, pp_rank
        )
        self.loss_fn = cross_entropy_loss
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.loss_fn = torch.compile(cross_entropy_loss, backend=cfg.compile.backend)
        self.model_parts, self.pipeline, self.flops_per_token = build_model_parts(
            spec, self.model_args, self.parallel_dims, cfg, self.device, self.loss_fn
        )
        # Under PP, one module over this rank's stages with the unsplit model's names.
        self.model = (
            self.model_parts[0] if self.pipeline is None else ModelPartsView(self.model_parts)
        )
        # Fixed once parallelized (FSDP2 keeps the same sharded parameters across steps).
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.moe_stats = MoEStats(
            self.model, self.model_args, self._dp_cp_group(), self._pp_group(), self.device
        )
        for stage in self.pipeline.stages if self.pipeline is not None else []:
            if hasattr(stage, "_forward_metadata_inference"):  # torch's first-step shape pass
                self.moe_stats.exclude_forwards_of(stage, "_forward_metadata_inference")
        # A model training multi-token prediction: its loss's scale and the mtp/loss metric.
        self.mtp_stats = MTPStats(
            self.model,
            self._dp_cp_group(),
            self._pp_group(),
            self.device,
            context_parallel=self.parallel_dims.cp,
        )
        # A forward that reads targets ahead (MTP) gets them, built before CP splits the window.
        self._labels_ahead = 0 if self.pipeline is not None else labels_ahead_depth(self.model)
        self._autocast_dtype = autocast_dtype(cfg.training, self.parallel_dims.fsdp_enabled)
        self.evaluators = self._build_evaluators()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.train_state = TrainState(rank=self.dist.rank)
        self.guard = self._build_guard()
        self._rollbacks: list[int] = []  # steps at which the guard rolled back
        self._damped_until = 0  # the last step of a rollback's learning-rate damping
        mine = [(k, s) for k, s, r in parse_injections(cfg.debug.inject) if r == self.dist.rank]
        drills = ("slow_rank", "bitflip", "overflow_update")  # not a change of loss or gradients
        self.injections = [(k, s) for k, s in mine if k not in drills]
        self._overflows = {s for k, s in mine if k == "overflow_update"}
        self._slow_from = min((s for k, s in mine if k == "slow_rank"), default=None)
        self._slow_seconds = 0.0  # the slow-rank drill's extra compute per step, set at its start
        self._bitflips = {s for k, s in mine if k == "bitflip"}
        h = cfg.health
        self.stragglers = (
            StragglerMonitor(h.straggler_factor, self.device, self.dist.world_size, pp_rank)
            # Simulated ranks (comm.mode fake_backend, local_tensor) share one process: nothing
            # to compare, and local_tensor's collectives take only its own tensors.
            if h.enable
            and h.straggler_factor
            and self.dist.world_size > 1
            and cfg.comm.mode == "default"
            else None
        )
        states = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": LRSchedulerState(self.lr_scheduler),
            "dataloader": self.dataloader,
            "train_state": self.train_state,
        }
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            states,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        if self.guard is not None:
            self.guard.rollback_blocker = self._rollback_blocker
        self.semi = None  # semi-synchronous replica groups: their weight syncs
        if ft.enable and ft.semi_sync != "off":
            self.semi = fault_tolerance.SemiSync(ft, self._params)
            states = {**states, "semi_sync": self.semi}  # heals with the rest; not checkpointed
        self.ft = (
            fault_tolerance.ReplicaGroup(ft, groups, self.device, states, self._healed)
            if ft.enable
            else None
        )
        self._committed = True  # the last step's update was applied (always, without ft)
        self._stop_vote: str | None = None  # replica groups: this group's stop request, if any
        self._stop_agreed = False  # replica groups: some group saw one at this step
        self._stop_pending: str | None = None  # agreed on; semi-sync groups stop at a sync
        self._reopen_data = False  # a heal moved the data position: read on from there
        self.checkpointer.model_description = describe_model(cfg.model.name, self.model_args)
        if cfg.checkpoint.initial_load_in_hf:
            from titan_core.checkpoint.hf_weights import load_hf_into_model

            self.checkpointer.hf_loader = load_hf_into_model
        self.extra_sinks = extra_sinks or []
        self.metrics: MetricsProcessor | None = None
        self.stop_requests = StopRequests(cfg.job.dump_folder, self.dist.is_rank0, self.device)

    # ------------------------------------------------------------------ building
    def _build_loader(
        self,
        data: Dataloader,
        dp_rank: int,
        infinite: bool,
        batch_size: int | None = None,
        dp_world: int | None = None,
    ) -> Any:
        t = self.cfg.training
        key = (data.dataset, data.path, data.split, batch_size)
        if not infinite and key in self._finite_loaders:  # a prepared pass restarts by itself
            return self._finite_loaders[key]
        loader = build_dataloader(
            data,
            tokenizer=self.tokenizer,
            local_batch_size=batch_size or t.local_batch_size,
            seq_len=t.seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world or self.parallel_dims.dp_degree,
            infinite=infinite,
        )
        if not infinite and isinstance(loader, PreparedDataloader):  # checked and opened once
            self._finite_loaders[key] = loader
        return loader

    def _build_validator(self, dp_rank: int) -> Validator:
        v, data = self.cfg.validation, validation_dataloader(self.cfg)
        batch_size = validation_data(self.cfg)["local_batch_size"]

        def build() -> Any:
            return self._build_loader(data, dp_rank, False, batch_size)

        if v.enable:
            build()  # fail now, before writing anything, if the split is missing or empty
        pp_group = self.parallel_dims.mesh["pp"].get_group() if self.parallel_dims.pp > 1 else None
        return Validator(
            v,
            build,
            cross_entropy_loss,
            self.device,
            self._dp_cp_group(),
            pp_group,
            self._train_context,
        )

    def _build_evaluators(self) -> Evaluators | None:
        """The in-loop evaluators (``[evaluators]``), their data read once; none when there are
        none, or when the ranks are simulated (nothing real to score)."""
        if not self.cfg.evaluators.sets:
            return None
        if self.cfg.comm.mode != "default":
            logger.info("evaluators: skipped under comm.mode %s", self.cfg.comm.mode)
            return None
        return build_evaluators(
            self.cfg,
            self.tokenizer,
            device=self.device,
            group=self._eval_group(),
            forward_context=self._autocast,
            forward=self._eval_logits,
            pp_group=self._pp_group(),
        )

    def _eval_group(self) -> dist.ProcessGroup | None:
        """The ranks that share the evaluation's batches: the data-parallel ones. TP, CP and
        PP ranks of one data-parallel rank run the same forwards (each its part of them)."""
        if self.parallel_dims.dp_enabled:
            return self.parallel_dims.dp_mesh.get_group()
        if self.dist.world_size > 1:  # no data parallelism: every rank scores every batch
            return dist.new_subgroups(group_size=1)[0]
        return None

    @torch.no_grad()
    def _eval_logits(self, inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | None:
        """Whole logits (bs, seq, vocab) of one evaluation forward, as one process computes
        them: through the pipeline's stages (None on ranks without the last stage), over the
        CP ranks' sequence shards (gathered in order), with TP's vocab shards gathered."""
        width, cp = inputs.shape[1], self.parallel_dims.cp
        stack = contextlib.ExitStack()
        if cp > 1:  # the RoPE table's shards line up with seq_len tokens: pad on the right
            padded = inputs.new_zeros(inputs.shape[0], self.cfg.training.seq_len)
            padded[:, :width] = inputs
            inputs = padded
            stack.enter_context(self._cp_context(inputs, torch.zeros_like(inputs)))
        with stack:
            if self.pipeline is not None:
                logits = self.pipeline.eval_logits(inputs)
            else:
                logits = self.model(inputs, **kwargs)
        if isinstance(logits, DTensor):  # loss parallel: sharded along the vocabulary
            logits = logits.full_tensor()
        if cp > 1 and logits is not None:
            logits = self._cp_unshard(logits)[:, :width]
        return logits

    def _cp_unshard(self, local: torch.Tensor) -> torch.Tensor:
        """The whole sequence (dim 1) from each CP rank's head-tail shard: rank r holds
        chunks r and 2 * cp - 1 - r of 2 * cp."""
        group = self.parallel_dims.mesh["cp"].get_group()
        shards = [torch.empty_like(local) for _ in range(self.parallel_dims.cp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        heads = [shard.chunk(2, dim=1)[0] for shard in shards]
        tails = [shard.chunk(2, dim=1)[1] for shard in reversed(shards)]
        return torch.cat(heads + tails, dim=1)

    def _dp_cp_group(self) -> dist.ProcessGroup | None:
        """The data x context parallel ranks (whose tokens make up the batch), if any."""
        if self.parallel_dims.dp_enabled or self.parallel_dims.cp_enabled:
            return self.parallel_dims.dp_cp_mesh.get_group()
        return None

    def _build_guard(self) -> HealthGuard | None:
        """The step guard (``[health]``), when on; its loss is the global mean, so the log line
        needs no second all-reduce."""
        if not self.cfg.health.enable:
            return None
        pp = self.parallel_dims.pp if self.pipeline is not None else 1
        return HealthGuard(
            self.cfg.health,
            device=self.device,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            loss_scale=pp / self.dist.world_size,
            min_history=self.cfg.lr_scheduler.warmup_steps,
            folder=self.side_folder,
            is_rank0=self.dist.is_rank0,
        )

    def _guard_point(
        self, step: int, final: bool, data_iter: Any
    ) -> tuple[dict[str, float], Any | None]:
        """Where the host reads the guard (log, save and last steps, and when its records are
        full): report, stop (``HealthStop``) or roll back; and the next save's health mark.
        Returns the guard's metrics and, after a rollback, the data iterator to go on with."""
        saving = self.checkpointer.should_save(step, final)
        metrics: dict[str, float] = {}
        guard = self.guard
        if guard is not None and (self.metrics.should_log(step) or final or saving or guard.full):
            try:
                guard.flush()  # raises HealthStop when the policy says stop
                if guard.rollback is not None:
                    return {}, self._rollback(data_iter, step)
            except HealthStop as e:
                raise HealthStop(f"{e}; {self._newest_checkpoint()}") from None
            metrics = guard.metrics()
            if self.stragglers is not None and (self.metrics.should_log(step) or final):
                guard.record_stragglers(self.stragglers.report(step))
                metrics |= self.stragglers.metrics()
        # The weights are checked where it is cheap and certain: at a save (what is saved), and
        # at the step after one (an update that overflowed right after a save is found before
        # it costs more steps: the checkpoint just saved is the rollback's). An overflowed update
        # is no NaN loss yet.
        after_save = (
            guard is not None and step > 1 and self.checkpointer.should_save(step - 1, False)
        )
        if saving or after_save:
            counts = self._nonfinite_tensors()
            if any(counts) and guard is not None:  # stop, or roll back: nothing is saved
                try:
                    guard.nonfinite_weights(step, counts)
                except HealthStop as e:
                    raise HealthStop(f"{e}; {self._newest_checkpoint()}") from None
                return {}, self._rollback(data_iter, step)
        if saving:
            if any(counts):
                logger.warning(
                    "step %d: the weights are not finite (ranks %s); saved marked unhealthy "
                    "(health.enable is off), the newest healthy checkpoint is kept",
                    step,
                    [r for r, n in enumerate(counts) if n],
                )
            mark = guard.mark() if guard is not None else {"guard": False}
            self.checkpointer.health = {"healthy": not any(counts), **mark}
        return metrics, None

    def _rollback(self, data_iter: Any, step: int) -> Any:
        """Roll back to the newest healthy checkpoint before the guard's incident, keep the data
        cursor where it is (the samples read since the checkpoint are skipped), and return the
        data iterator to go on with. (Where none can be done the guard stopped instead.)"""
        h, incident = self.cfg.health, self.guard.rollback
        assert incident is not None
        # The guard asked _rollback_blocker before it chose to roll back: a target exists.
        target = self._rollback_target(incident.step)
        assert target is not None, "the guard rolls back only where _rollback_blocker allows"
        if hasattr(data_iter, "close"):
            data_iter.close()  # its prefetch thread stops; the loader's state is what it handed out
        data_state = self.dataloader.state_dict()
        target, model_only = self.checkpointer.load_step(target)
        since = getattr(self.dataloader, "position", None)  # prepared data: the global order
        if model_only:  # no data position in it: the seed's is the run's start, others unknown
            since = 0 if target == 0 and since is not None else None
        self.dataloader.load_state_dict(data_state)
        if model_only:  # the seed: the optimizer and the schedule start over too
            self.optimizer.state.clear()
            LRSchedulerState(self.lr_scheduler).load_state_dict({"last_epoch": target})
        self.train_state.step = target
        self.guard.reset()
        if self.stragglers is not None:
            self.stragglers.reset()
        self._rollbacks.append(step)
        self._damped_until = target + h.rollback_lr_steps
        skipped = ""
        if since is not None:
            until = self.dataloader.position
            skipped = f"; samples {since}:{until} of the data order skipped (dataloader.exclude)"
        line = f"health: step {step}: rolled back to step {target}{skipped}"
        if h.rollback_lr_steps and h.rollback_lr_factor != 1:
            line += f"; lr x {h.rollback_lr_factor:g} for {h.rollback_lr_steps} steps"
        self.guard.record_rollback(
            line, step, target, (since, until) if since is not None else None
        )
        return iter(self.dataloader)

    def _rollback_blocker(self, incident: Incident) -> str | None:
        """Why the guard cannot roll back for ``incident`` (the reason its stop line gives),
        or None: too many rollbacks lately, or no healthy checkpoint before it."""
        h, step = self.cfg.health, self.train_state.step
        recent = [s for s in self._rollbacks if s > step - h.rollback_window]
        if len(recent) >= h.max_rollbacks:
            return (
                f"{len(recent)} rollbacks within {h.rollback_window} steps "
                f"(health.max_rollbacks = {h.max_rollbacks})"
            )
        if self._rollback_target(incident.step) is None:
            return "no checkpoint to roll back to"
        return None

    def _rollback_target(self, before: int) -> int | None:
        """The newest healthy complete checkpoint before step ``before`` (0: the seed), or
        None."""
        if not self.cfg.checkpoint.enable:
            return None
        self.checkpointer.wait()  # an async save in flight is of a step before the incident
        return self._newest_healthy(before)

    def _newest_healthy(self, before: int | None = None) -> int | None:
        """The newest complete step (before ``before``) not marked unhealthy, 0 for the seed
        checkpoint when there is none, or None."""
        folder = self.checkpointer.folder
        steps = [s for s in complete_steps(folder) if before is None or s < before]
        if (step := newest_healthy(folder, steps)) is not None:
            return step
        return 0 if read_marker(self.checkpointer.seed_dir) is not None else None

    def _nonfinite_tensors(self) -> list[int]:
        """Every rank's number of non-finite tensors among its weights and optimizer state (what
        a save writes): one pass over them and one all-reduce, at save points only, where the
        host synchronizes anyway."""
        tensors = [*self._params]
        for state in self.optimizer.state.values():  # the moments (not step counters: a count
            # is finite, and a non-fused optimizer keeps it on the CPU, away from the weights)
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        local = [t.detach() for t in local if t.numel()]  # FSDP may leave a rank an empty shard
        counts = torch.zeros(self.dist.world_size, device=self.device)
        if local:  # the largest magnitude of each: NaN and inf stay what they are
            largest = torch.stack(torch._foreach_norm(local, math.inf))
            counts[self.dist.rank] = (~torch.isfinite(largest)).sum().float()
        if self.dist.world_size > 1:
            dist.all_reduce(counts)
        return [int(n) for n in counts.tolist()]

    def _lr_factor(self, step: int) -> float:
        """The learning-rate damping after a rollback (1.0 outside it)."""
        return self.cfg.health.rollback_lr_factor if step <= self._damped_until else 1.0

    def _newest_checkpoint(self) -> str:
        """Where a stopped run's healthy state is, for the guard's stop line: the newest
        checkpoint whose marker says its weights are finite (the seed if there is no step)."""
        if not self.cfg.checkpoint.enable:
            return "no checkpoint of this run was saved"
        self.checkpointer.wait()  # an async save in flight is of a step before the anomaly
        steps = complete_steps(self.checkpointer.folder)
        healthy = self._newest_healthy()
        if healthy is None:
            if steps:
                return "no healthy checkpoint: every one holds non-finite weights"
            return "no checkpoint of this run was saved"
        where = self.checkpointer.seed_dir if healthy == 0 else self.checkpointer.step_dir(healthy)
        if steps and steps[-1] > healthy:  # a resume passes over the newer, unhealthy ones
            how = ": a resume passes over them" if healthy else ""
            return f"newest healthy checkpoint: {where} (newer ones hold non-finite weights{how})"
        return f"newest checkpoint (healthy): {where}"

    def _build_metrics(self) -> MetricsProcessor:
        cfg, side = self.cfg, self.side_folder
        sinks: list[MetricsSink] = [ConsoleSink(cfg.metrics.color)]
        if self.dist.is_rank0:
            if cfg.metrics.enable_jsonl:
                sinks.append(JsonlSink(os.path.join(side, "metrics.jsonl")))
            if cfg.metrics.enable_tensorboard:
                sinks.append(TensorBoardSink(os.path.join(side, cfg.metrics.save_tb_folder)))
            sinks.extend(self.extra_sinks)
            mlflow = mlflow_sink_from_env() if self._first_group else None  # one group tracks
            if mlflow is not None:  # set by the pipeline's train task
                sinks.append(mlflow)
        dtype = compute_dtype(cfg.training, self.parallel_dims.fsdp_enabled)
        peak = device_peak_tflops(self.device, cfg.metrics, dtype)
        logger.info("MFU divides by a peak of %.4g TFLOP/s per rank (%s)", peak.tflops, peak.source)
        params = {"mfu.peak_tflops": f"{peak.tflops:.6g}", "mfu.peak": peak.source}
        # Damaged steps the resume passed over (newest first), each with why.
        params |= {f"checkpoint.damaged.step-{s}": why for s, why in self.checkpointer.skipped}
        for sink in sinks:  # recorded with the run: MLflow params
            if hasattr(sink, "log_params"):
                sink.log_params(params)
        return MetricsProcessor(
            cfg.metrics,
            self.flops_per_token,
            peak.tflops,
            MemoryMonitor(self.device),
            sinks,
            peak_source=peak.source,
        )

    def _write_config(self) -> None:
        """Save the config as this run ran it (``resolved_config``): what the pipeline's
        preflight stored and logged, so a run's config.toml and its MLflow params agree."""
        # The job's config (under fault tolerance: all replica groups, not this one's view).
        text = to_toml(resolved_config(self.job_cfg, self.parallel_dims, self.model_args))
        if self.dist.is_rank0 and self.cfg.job.save_config and self._first_group:
            storage.write_text(storage.join(self.cfg.job.dump_folder, "config.toml"), text)
        if self.cfg.job.print_config:
            logger.info("Resolved config:\n%s", text)

    # ------------------------------------------------------------------ stepping
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _train_context(
        self, inputs: torch.Tensor, labels: torch.Tensor, *more: torch.Tensor
    ) -> contextlib.ExitStack:
        """Contexts around one micro-batch's forward and backward (loss parallel, CP; ``more``:
        other (bs, seq, ...) tensors CP splits with the tokens)."""
        stack = contextlib.ExitStack()
        if self.parallel_dims.loss_parallel_enabled(self.cfg.parallelism):
            stack.enter_context(loss_parallel())
        if self.parallel_dims.cp_enabled:
            stack.enter_context(self._cp_context(inputs, labels, *more))
        return stack

    def _cp_context(
        self, inputs: torch.Tensor, labels: torch.Tensor, *more: torch.Tensor
    ) -> contextlib.AbstractContextManager:
        """Shard this micro-batch and the RoPE tables along the sequence; SDPA runs as a ring."""
        buffers, seq_dims, no_restore = model_cp_buffers(self.model_parts, inputs, labels, more)
        return context_parallel_context(
            self.parallel_dims.mesh["cp"],
            buffers,
            seq_dims,
            no_restore,
            self.cfg.parallelism.context_parallel_rotate_method,
        )

    def _forward_backward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        scale: float,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (``doc_ids`` under document masking);
        returns the detached scaled loss (under PP: the last stage's loss, zero on other
        stages' ranks)."""
        if self.pipeline is not None:
            assert doc_ids is None, "check_job refuses document masking with PP"
            with self._train_context(inputs, labels), self._autocast():
                return self.pipeline.step(inputs, labels, scale)
        extra = {}
        if self._labels_ahead:  # (bs, seq, depth + 1), split by CP with the tokens
            extra["labels_ahead"] = labels_ahead(labels, self._labels_ahead)
        with self._train_context(inputs, labels, *extra.values()):
            with self._autocast():
                pred = self.model(inputs, doc_ids=doc_ids, **extra)  # (bs, seq, vocab)
            loss = self.loss_fn(pred, labels) * scale
            del pred  # free the logits before backward needs the memory
            loss.backward()
        return loss.detach()

    def train_step(
        self, batches: list[tuple[torch.Tensor, ...]], step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``batches`` of (inputs, labels[, doc_ids]) (gradient
        accumulation); returns detached (loss, grad_norm) without synchronizing the host.

        With the guard on, the loss is the global mean (NaN when a rank's was not finite) and
        the update is applied only when the guard passes it: the fused optimizer reads its
        verdict as ``found_inf`` on the device; the other implementations read it on the host."""
        if self._slow_from is not None and step >= self._slow_from:  # the slow-rank drill
            if not self._slow_seconds:  # this rank's compute x 3 from now on
                last = self.stragglers.last_compute if self.stragglers is not None else 0.0
                self._slow_seconds = max(0.02, 2 * last)
            slow_down(self._slow_seconds)
        if step in self._bitflips:  # the bit-flip drill: this step's first forward only
            arm_bitflip(self._flip_target())
        loss_sum = self._accumulate(batches)
        sdc = None
        every = self.cfg.health.sdc_every if self.guard is not None else 0
        if every and step % every == 0:  # the same inputs again: the same result?
            first = (loss_sum, grad_fingerprint(self._params))
            loss_sum = self._accumulate(batches)
            exact = self.device.type == "cpu" or self.cfg.debug.deterministic
            sdc = recompute_verdict(first, (loss_sum, grad_fingerprint(self._params)), exact)
        if due := [i for i in self.injections if i[1] == step]:  # a drill fires once
            loss_sum = inject_faults(due, step, loss_sum, self._params)
            self.injections = [i for i in self.injections if i[1] != step]
        if self.ft is not None and self.semi is None:  # gradients and loss, over the groups
            loss_sum = self._average_over_groups(loss_sum)
        grad_norm = dist_utils.clip_grad_norm_(
            self._params, self.cfg.training.max_norm, self._pp_group()
        )
        apply = True
        if self.guard is not None:
            found_inf, loss_sum = self.guard.check(step, loss_sum, grad_norm, sdc)
            if self.cfg.optimizer.implementation == "fused":
                self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            else:
                apply = not bool(found_inf.item())  # foreach / for-loop: no device-side skip
        self.checkpointer.wait_for_staging()  # a background save may still be copying weights
        if self.ft is not None and self.semi is None:  # every live group got through the step
            self._committed = self.ft.commit()  # or none applies it
            apply = apply and self._committed
            if not self._committed:
                return loss_sum, grad_norm
        if apply:
            factor = self._lr_factor(step)
            if step in self._overflows:  # the drill (once): this update overflows (lr = inf)
                self._overflows.discard(step)
                factor = math.inf
            scheduled = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * factor
            self.optimizer.step()
            for g, lr in zip(self.optimizer.param_groups, scheduled, strict=True):
                g["lr"] = lr
        self.lr_scheduler.step()
        if self.semi is not None:
            loss_sum = self._sync_groups(step, loss_sum)
        return loss_sum, grad_norm

    def _sync_groups(self, step: int, loss_sum: torch.Tensor) -> torch.Tensor:
        """Semi-synchronous replica groups, after this group's own update: the loss and stop
        vote averaged over the live groups, and at a sync step the weights too (see
        ``fault_tolerance.SemiSync``). A sync that does not commit keeps each group's own
        weights until the next one; the step is not redone. Returns the averaged loss."""
        assert self.ft is not None and self.semi is not None
        sync = self.semi.due(step, step == self.cfg.training.steps)
        payload = self.semi.payload() if sync else []
        vote = 0.0 if self._stop_vote is None else 1.0
        loss = torch.stack([loss_sum.detach().float(), torch.tensor(vote, device=self.device)])
        self.ft.average([*payload, loss])
        if sync:
            ok = self.ft.commit("the weights' sync", "each group keeps its own until the next")
        else:
            ok = self.ft.commit("the loss's average", "this group's loss is logged")
        if not ok:
            self._stop_agreed = self._stop_vote is not None
            return loss_sum
        if sync:
            self.semi.apply(payload)
        self._stop_agreed = bool(loss[1] > 0)
        return loss[0]

    def _average_over_groups(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Average this rank's gradient shards and loss with the same rank of every live
        replica group (the layouts are the same in every group); the averaged loss."""
        assert self.ft is not None
        grads = []
        for p in self._params:
            if p.grad is None:  # unused this step here, maybe not in another group
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        vote = 0.0 if self._stop_vote is None else 1.0
        loss = torch.stack([loss_sum.detach().float(), torch.tensor(vote, device=self.device)])
        self.ft.average([*grads, loss])
        self._stop_agreed = bool(loss[1] > 0)  # some group saw a stop request
        return loss[0]

    def _agreed_stop(self, step: int) -> str | None:
        """The stop request the replica groups agreed on at this step, if any. Semi-synchronous
        groups agree at the same step and stop at the next sync (weights averaged)."""
        if self._stop_agreed and self._stop_pending is None:
            vote = self._stop_vote
            self._stop_pending = vote if vote is not None else "seen by another replica group"
        if self.semi is not None and not self.semi.due(step, False):
            return None
        reason, self._stop_pending = self._stop_pending, None
        return reason

    def _record_replica_events(self) -> None:
        """The replica groups' events since the last call, into the health log (at the step
        they happened before or in: the next one to commit)."""
        assert self.ft is not None
        if self.ft.events and self.guard is not None:
            self.guard.record_replica_groups(self.train_state.step + 1, self.ft.events)
        self.ft.events = []

    def _healed(self) -> None:
        """A peer's state was loaded: the data is read on from its position."""
        self._reopen_data = True

    @property
    def _first_group(self) -> bool:
        """Group 0 of a fault-tolerant job (or any job without): it writes the job's files."""
        return self.job_cfg.fault_tolerance.group_id <= 0

    def _accumulate(self, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """Zeroed gradients, then forward and backward of every micro-batch; the summed loss."""
        self.optimizer.zero_grad()
        # Each forward's aux-loss gradient gets its training loss's factor: 1 / accumulation
        # steps, and under PP also 1 / microbatches (PipelineRunner.step scales each one's loss).
        microbatches = self.pipeline.num_microbatches if self.pipeline is not None else 1
        self.moe_stats.start_step(1.0 / (len(batches) * microbatches))
        self.mtp_stats.start_step(1.0 / (len(batches) * microbatches))  # the same for MTP's
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels, *doc_ids in batches:  # doc_ids: [] or [(bs, seq)] when masking
            loss = self._forward_backward(inputs, labels, 1.0 / len(batches), *doc_ids)
            # Under loss parallel the loss is a replicated DTensor: its local value is the loss.
            loss_sum += loss.to_local() if isinstance(loss, DTensor) else loss
        return loss_sum

    def _flip_target(self) -> torch.nn.Module:
        """Where the bit-flip drill flips: this rank's first linear layer."""
        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, torch.nn.Linear):
                    return module
        raise RuntimeError("bit-flip drill: no linear layer on this rank")

    def _next_batches(self, data_iter: Any) -> list[tuple[torch.Tensor, ...]]:
        start = time.perf_counter()
        batches = []
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            # (inputs, labels), plus doc_ids under document masking
            batches.append(tuple(t.to(self.device) for t in next(data_iter)))
        waited = time.perf_counter() - start
        self.metrics.add_data_time(waited)
        if self.stragglers is not None:
            self.stragglers.add_data(waited)
        return batches

    def _pp_group(self) -> dist.ProcessGroup | None:
        return self.parallel_dims.mesh["pp"].get_group() if self.pipeline is not None else None

    def _reduce_for_log(self, loss: torch.Tensor) -> float:
        if self.dist.world_size > 1 and self.guard is None:  # the guard's loss is global
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            if self.pipeline is not None:  # only the last stage's ranks (1 in pp) hold a loss
                loss *= self.parallel_dims.pp
        return loss.item()

    def _restore(self) -> int:
        step = self.train_state.step = self.checkpointer.load()
        if self.lr_scheduler.last_epoch != step:  # a model-only checkpoint has no schedule
            LRSchedulerState(self.lr_scheduler).load_state_dict({"last_epoch": step})
        return step

    def _record(
        self,
        step: int,
        last: bool,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        extra: dict[str, float] | None = None,
    ) -> dict[str, float] | None:
        """Log metrics (plus ``extra``, e.g. the MoE load) and run validation when due; the
        step's row for the history, if any."""
        row: dict[str, float] | None = None
        if self.metrics.should_log(step) or last:
            lr = self.lr_scheduler.get_last_lr()[0] * self._lr_factor(step)  # damped: as applied
            row = {
                "step": step,
                **self.metrics.log(step, self._reduce_for_log(loss), grad_norm.item(), lr, extra),
            }
            if mix := self.dataloader.metrics():
                self.metrics.log_scalars(step, mix)  # realized shares of a dataset mix
                row |= mix
        if self.validator.should_validate(step, last):
            val = self.validator.validate(self.model_parts, self.pipeline)
            logger.info("step: %5d  validation loss: %.4f", step, val["validation/loss"])
            self.metrics.log_scalars(step, val)
            row = {**(row or {"step": step}), **val}
        if self.evaluators is not None and self.evaluators.due(step, last):
            row = {**(row or {"step": step}), **self._evaluate(step)}
        return row

    def _evaluate(self, step: int) -> dict[str, float]:
        """Run the in-loop evaluators and log their metrics at ``step``; their time is left
        out of the training throughput."""
        assert self.evaluators is not None
        start = time.perf_counter()
        scores = self.evaluators.run(self.model, step)
        self.metrics.log_scalars(step, scores)
        self.metrics.exclude_time(time.perf_counter() - start)
        return scores

    def train(self) -> list[dict[str, float]]:
        """Run until ``training.steps``; returns the logged metrics of each logged step."""
        cfg = self.cfg
        quorum = False  # the next step's quorum is already formed
        if self.ft is not None:
            self.ft.wait_for_groups(self.job_cfg.fault_tolerance.quorum_timeout_seconds)
        if self.ft is not None and self.ft.start_step():
            # Behind a live replica group: healed from it (weights, optimizer, schedule, data
            # position, step), nothing read from storage.
            start_step, quorum = self.train_state.step, True
        else:  # no group ahead (a fresh job, or every group restarted): from storage
            start_step, quorum = self._restore(), self.ft is not None
            if self.semi is not None:
                self.semi.reset()  # the loaded weights are every group's last sync
        if start_step >= cfg.training.steps:
            logger.info(
                "Checkpoint is at step %d >= training.steps=%d: nothing to train",
                start_step,
                cfg.training.steps,
            )
            return []
        self._write_config()
        self.metrics = self._build_metrics()
        mem_profiler = None
        if cfg.profiling.enable_memory_snapshot:
            mem_profiler = MemoryProfiler(
                cfg.profiling,
                self.side_folder,
                self.dist.rank,
                self.device,
                self.model,
                self.optimizer,
            )
        t = cfg.training
        tokens_per_step = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps
        logger.info(
            "Training steps %d → %d, %d tokens/step/rank, world size %d",
            start_step + 1,
            t.steps,
            tokens_per_step,
            self.dist.world_size,
        )
        history: list[dict[str, float]] = []
        if self.evaluators is not None and cfg.evaluators.at_start and start_step == 0:
            history.append({"step": 0, **self._evaluate(0)})  # the model before training
        data_iter = iter(self.dataloader)
        gc.disable()  # collected every gc_freq steps instead, so pauses are predictable
        try:
            with maybe_enable_profiling(
                cfg.profiling, self.side_folder, self.dist.rank, start_step
            ) as profiler:
                while self.train_state.step < t.steps:
                    if self.ft is not None:
                        if not quorum:
                            self.ft.start_step()
                        quorum = False
                        self._record_replica_events()
                        if self._reopen_data:  # healed: on from the live group's position
                            data_iter = self._reopened(data_iter)
                        if self.train_state.step >= t.steps:
                            break
                    step = self.train_state.step = self.train_state.step + 1
                    who = self.dist.rank if self.ft is None else self.ft.group_id
                    fault_tolerance.maybe_kill(step, who)  # drills only
                    if self.ft is not None:
                        self.ft.maybe_slow()
                        # Replica groups look for a stop request before the step and average
                        # their answers with its gradients: all of them stop at the same step.
                        looks = step != t.steps and self.metrics.should_log(step)
                        self._stop_vote = self.stop_requests.check() if looks else None
                    if step % t.gc_freq == 0:
                        gc.collect(1)
                    batches = self._next_batches(data_iter)
                    flight_recorder.maybe_inject_hang(step, self.dist.rank)
                    if self.stragglers is not None:
                        self.stragglers.train_begin()
                    try:
                        loss, grad_norm = self.train_step(batches, step)
                    except torch.OutOfMemoryError:
                        if mem_profiler:
                            mem_profiler.step(step, exit_=True)
                        raise
                    if self.stragglers is not None:
                        self.stragglers.train_end()
                    if not self._committed:  # a replica group failed in it: redo the step
                        self.train_state.step -= 1
                        self._record_replica_events()
                        continue
                    if step == start_step + 1:  # the slow first step is done: tighten timeouts
                        flight_recorder.set_pg_timeouts(cfg.comm.train_timeout_seconds)
                    self.train_state.ntokens_seen += tokens_per_step
                    # Per device, as torchtitan counts: ranks of one data stream (tp, cp, pp)
                    # share its tokens, so tps and MFU stay per-device figures.
                    self.metrics.add_step(
                        tokens_per_step / self.parallel_dims.non_data_parallel_size
                    )
                    last = step == t.steps
                    # A requested stop makes this the final step: logged, validated and saved.
                    asked = not last and self.metrics.should_log(step)
                    if self.ft is None:
                        stop_reason = self.stop_requests.check() if asked else None
                    else:
                        stop_reason = self._agreed_stop(step)
                    final = last or stop_reason is not None
                    health, rolled_back = self._guard_point(step, final, data_iter)
                    if rolled_back is not None:  # on from the checkpoint's step
                        data_iter = rolled_back
                        continue
                    # MoE: loss-free bias update from the batch-wide expert counts (every
                    # step, when on) and the load metrics (on log steps).
                    moe = self.moe_stats.end_step(self.metrics.should_log(step) or final)
                    mtp = self.mtp_stats.end_step(self.metrics.should_log(step) or final)
                    groups = self.ft.metrics() if self.ft is not None else {}
                    if self.semi is not None:
                        groups["ft/syncs"] = float(self.semi.syncs)
                    extra = {**moe, **mtp, **health, **groups}
                    if row := self._record(step, final, loss, grad_norm, extra):
                        history.append(row)
                    if self.ft is None or self.ft.saves():  # one replica group saves
                        self.checkpointer.save(step, last=last, stop=stop_reason is not None)
                    self.checkpointer.poll()
                    if profiler is not None:
                        profiler.step()
                    if mem_profiler:
                        mem_profiler.step(step)
                    if stop_reason is not None:
                        self.checkpointer.wait()  # the stop's save is committed before its record
                        if self.ft is None or self.ft.saves():  # who saved it records it
                            self.stop_requests.consume(step, stop_reason)
                        else:
                            logger.info("stopped early at step %d (stop requested)", step)
                        break
        finally:
            gc.enable()
            if mem_profiler:
                mem_profiler.close()
        if self.train_state.step == t.steps:
            self.stop_requests.drop_late()
        logger.info(
            "Training done at step %d; data skipped: %s",
            self.train_state.step,
            self.dataloader.stats,
        )
        return history

    def _reopened(self, data_iter: Any) -> Any:
        """A new iterator at the data loader's (healed) position; the old one is closed."""
        self._reopen_data = False
        if hasattr(data_iter, "close"):
            data_iter.close()
        return iter(self.dataloader)

    def close(self) -> None:
        """Finish background saves, close sinks, and tear down the process group."""
        if self.ft is not None:
            self.ft.close()
        self.checkpointer.close()
        if self.stragglers is not None:
            self.stragglers.close()
        if self.metrics is not None:
            self.metrics.close()
        dist_utils.destroy_process_group()
