"""The step guard: every step's loss and gradient norm checked on all ranks before the update.

Per step, on the device and without a host synchronization:

1. one all-reduce (over every rank of every mesh dimension) of this rank's loss and a
   "my loss is not finite" flag gives the global loss and whether any rank saw a bad one; the
   gradient norm is already global (``clip_grad_norm_`` reduces it over every mesh);
2. a rolling window of the last ``spike_window`` healthy steps' loss and gradient norm gives
   their mean and standard deviation; a value above ``mean + spike_threshold * std`` is a
   spike (looked for once the window is full and the learning-rate warm-up is over);
3. the verdict is a device flag that the optimizer reads as ``found_inf``: the fused AdamW/Adam
   kernel then applies nothing (parameters, moments and the step counter stay bitwise as they
   were), as it does for ``GradScaler``. A ``stop`` verdict also latches: every later update is
   dropped until the host acts.

The host reads the per-step records only where it synchronizes anyway (log steps, checkpoint
saves, the last step; at least every ``CAPACITY`` steps) and then names the ranks, writes one
console line and one ``health.jsonl`` row per incident, and stops the run (``HealthStop``, exit
code 4) when the policy says so or the anomalies persist. An update that overflows leaves the
weights non-finite while its own loss and gradient norm were finite: the trainer checks the
weights at every save point (``nonfinite_weights``). docs/health.md has the policies.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from titan_core import storage
from titan_core.components.stragglers import Straggler
from titan_core.config.job import Health
from titan_core.errors import TitanError
from titan_core.logging import logger

CAPACITY = 100  # most steps between two host reads of the records
# The kinds of anomaly, as bits of a step's code.
LOSS_NONFINITE, GRAD_NONFINITE, LOSS_SPIKE, GRAD_SPIKE, SDC = 1, 2, 4, 8, 16
_KINDS = (
    (LOSS_NONFINITE, "loss", "nonfinite"),
    (GRAD_NONFINITE, "grad_norm", "nonfinite"),
    (LOSS_SPIKE, "loss", "spike"),
    (GRAD_SPIKE, "grad_norm", "spike"),
    (SDC, "recompute", "sdc"),
)
_SPIKE_FACTOR = 100.0  # what an injected spike multiplies its quantity by
# Columns of a step's record: global loss, grad norm, code, this rank's own loss, skipped,
# and the window's loss / grad-norm mean and std at that step.
_COLS = 9


def inject_faults(
    injections: list[tuple[str, int]], step: int, loss: torch.Tensor, params: list[torch.Tensor]
) -> torch.Tensor:
    """Apply this rank's ``debug.inject`` drills (kind, step) due at ``step``, after backward
    and before the guard: returns the loss to check (gradients are changed in place)."""
    for kind, at in injections:
        if at != step:
            continue
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if kind == "nan_loss":
            loss = loss * math.nan
        elif kind == "loss_spike":
            loss = loss * _SPIKE_FACTOR
        elif kind == "nan_grad" and local:
            local[0].view(-1)[:1] = math.nan
        elif kind == "grad_spike":
            torch._foreach_mul_(local, _SPIKE_FACTOR)
    return loss


SDC_RTOL = 1e-4  # recompute tolerance where kernels are not deterministic (CUDA, unless asked)
_FLIP_BIT = {torch.float32: 22, torch.bfloat16: 6, torch.float16: 9}  # the top mantissa bit


def grad_fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """Each parameter's local gradient as one float64 number (its sum of squares; 0 without a
    gradient), for comparing a step's two passes on the device."""
    sums = []
    for p in params:
        g = p.grad
        if g is None:
            sums.append(torch.zeros((), dtype=torch.float64, device=p.device))
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        sums.append(g.detach().double().square().sum())
    return torch.stack(sums)


def recompute_verdict(
    first: tuple[torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor],
    exact: bool,
) -> torch.Tensor:
    """This rank's verdict on a step computed twice, from (loss, gradient fingerprint) of
    each pass: (loss differs, gradients differ, loss's relative difference, gradients' largest
    relative difference) on the device. ``exact``: any difference counts (CPU kernels, or
    deterministic ones); else more than ``SDC_RTOL``. Two non-finite values agree."""

    def differ(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = a.double().reshape(-1), b.double().reshape(-1)
        finite = torch.isfinite(a) & torch.isfinite(b)
        rel = torch.where(finite, (a - b).abs() / b.abs().clamp(min=1e-30), 0.0)
        one_bad = torch.isfinite(a) != torch.isfinite(b)
        bad = (a != b if exact else rel > SDC_RTOL) & finite | one_bad
        return bad.any(), torch.where(one_bad, math.inf, rel).max()

    (loss_bad, loss_rel), (grad_bad, grad_rel) = (
        differ(first[0], second[0]),
        differ(first[1], second[1]),
    )
    return torch.stack([loss_bad.double(), grad_bad.double(), loss_rel, grad_rel])


def arm_bitflip(module: torch.nn.Module) -> None:
    """The bit-flip drill: the next forward of ``module`` (a leaf with a floating ``weight``)
    runs with one bit of this rank's working copy of the weight flipped (the top mantissa bit
    of its first element), then flips it back: a transient fault in this rank's compute, the
    kind a recompute finds."""

    def flip(*_: Any) -> None:
        w = module.weight
        w = (w.to_local() if hasattr(w, "to_local") else w).data  # .data: autograd is not told
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(w.dtype, torch.int16)
        w.view(-1)[:1].view(bits).bitwise_xor_(1 << _FLIP_BIT.get(w.dtype, 9))

    def before(*args: Any) -> None:
        flip()
        pre.remove()

    def after(*args: Any) -> None:
        flip()
        post.remove()

    pre = module.register_forward_pre_hook(before)
    post = module.register_forward_hook(after)


def _shown(quantity: str, value: float) -> float:
    """A window statistic as people read it: the gradient norm's are in log space (its mean
    is the geometric mean, its std a factor)."""
    return math.exp(value) if quantity == "grad_norm" else value


def _sdc_verdict(verdicts: list[list[float]]) -> tuple[list[int], str, float]:
    """Who a recompute mismatch names: the ranks whose own (not yet reduced) loss differed;
    when only gradients differed, the ranks that saw it in their reduced gradient shards (the
    fault is on one of the ranks that reduce into them). Also what differed, and by how much."""
    by_loss = [r for r, v in enumerate(verdicts) if v[0]]
    by_grad = [r for r, v in enumerate(verdicts) if v[1]]
    differs = " and ".join(w for w, rs in (("loss", by_loss), ("gradients", by_grad)) if rs)
    ranks = by_loss or by_grad
    value = max(max(verdicts[r][2], verdicts[r][3]) for r in ranks)
    return ranks, differs, value


class HealthStop(TitanError):
    """The guard stopped the run (policy ``stop``, or anomalies that persist)."""

    exit_code = 4


@dataclass
class Incident:
    """One anomaly: a step, a quantity and its value, who saw it, and what was done."""

    step: int
    quantity: str  # loss | grad_norm | weights | recompute
    kind: str  # nonfinite | spike | sdc
    value: float  # weights: the most non-finite tensors on one rank
    action: str  # skip | stop | rollback: what was done
    ranks: list[int] | None = None  # whose own loss was not finite; None: a global quantity
    mean: float | None = None  # the window's statistics, for a spike
    std: float | None = None
    differs: str | None = None  # sdc: what the recompute changed (loss, gradients)

    def line(self) -> str:
        """The console line."""
        where = f" on rank {', '.join(map(str, self.ranks))}" if self.ranks else ""
        what = f"{self.quantity} {self.value:.6g}{where}"
        if self.kind == "sdc":  # value: the largest relative difference of the two passes
            what = f"recompute differs ({self.differs}, relative {self.value:.3g}){where}"
        elif self.quantity == "weights":
            what = f"weights in {self.value:.0f} tensors{where}"
        elif self.kind == "spike" and self.quantity == "grad_norm":  # judged in log space
            what += f" (window geometric mean {self.mean:.6g}, spread x{self.std:.3g})"
        elif self.kind == "spike":
            what += f" (window mean {self.mean:.6g}, std {self.std:.3g})"
        done = {"skip": "update not applied", "stop": "stopping", "rollback": "rolling back"}[
            self.action
        ]
        return f"health: step {self.step}: {self.kind} {what} -> {self.action} ({done})"

    def row(self) -> dict[str, Any]:
        """The ``health.jsonl`` row (non-finite values as strings: JSON has no NaN)."""
        out = {
            "step": self.step,
            "quantity": self.quantity,
            "kind": self.kind,
            "value": self.value if math.isfinite(self.value) else str(self.value),
            "action": self.action,
            "ranks": self.ranks if self.ranks is not None else "all",
        }
        if self.kind == "spike":
            out |= {"mean": self.mean, "std": self.std}
        if self.kind == "sdc":
            out["differs"] = self.differs
        return out


@dataclass
class Counts:
    """What the guard has seen in this run (a resumed run counts from its start)."""

    incidents: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class HealthGuard:
    """The guard of one rank; every rank runs the same checks on the same global values."""

    def __init__(
        self,
        cfg: Health,
        *,
        device: torch.device,
        rank: int,
        world_size: int,
        loss_scale: float,
        min_history: int,
        folder: str,
        is_rank0: bool,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.loss_scale = loss_scale  # sum over ranks -> the logged mean (pp / world)
        self.min_history = max(min_history, cfg.spike_window)
        self.jsonl = os.path.join(folder, "health.jsonl") if is_rank0 else None  # local side folder
        self._rows: storage.LineLog | None = None
        self.is_rank0 = is_rank0
        policy = {"nonfinite": cfg.nonfinite, "spike": cfg.spike, "sdc": cfg.sdc}
        self.action = {bit: policy[kind] for bit, _, kind in _KINDS}
        # A stop or a rollback drops every update after the anomaly until the host acts.
        self.halt_bits = sum(bit for bit, action in self.action.items() if action != "skip")
        w = cfg.spike_window
        self._hist = torch.zeros(2, w, device=device)  # loss, log grad norm of finite steps
        self._floor = 1e-3
        self._count = torch.zeros((), dtype=torch.long, device=device)
        self._halted = torch.zeros((), dtype=torch.bool, device=device)
        self._records = torch.zeros(CAPACITY, _COLS, device=device)
        self._steps: list[int] = []  # the steps of the pending records (host-known)
        self._sdc: dict[int, torch.Tensor] = {}  # record index -> every rank's recompute verdict
        self._consecutive = 0
        self.counts = Counts()
        self.rollback: Incident | None = None  # set by flush(): the trainer rolls back
        self.rollback_blocker: Callable[[Incident], str | None] | None = None
        """Set by the trainer: why a rollback for this incident cannot be done (no checkpoint
        to go back to, too many rollbacks), or None; a blocked rollback stops the run."""

    def reset(self) -> None:
        """Start over after a rollback, as a resumed run does: an empty window, nothing
        pending, no latched verdict (the counts of the run stay)."""
        self._hist.zero_()
        self._count.zero_()
        self._halted.zero_()
        self._steps = []
        self._sdc = {}
        self._consecutive = 0
        self.rollback = None

    # ------------------------------------------------------------------ device side
    def check(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        sdc: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The verdict on this step: (``found_inf`` for the optimizer, 1.0 to drop the update;
        the global mean loss, NaN when some rank's loss was not finite). No host sync. ``sdc``:
        on a rechecked step, this rank's (loss differs, gradients differ, their relative
        differences) from ``recompute_verdict``."""
        loss = loss.detach().float().reshape(())
        own_bad = ~torch.isfinite(loss)
        both = torch.stack([torch.where(own_bad, torch.zeros_like(loss), loss), own_bad.float()])
        if self.world_size > 1:
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
        loss_bad = both[1] > 0
        global_loss = both[0] * self.loss_scale
        grad_norm = grad_norm.detach().float().reshape(())
        grad_bad = ~torch.isfinite(grad_norm)
        # The gradient norm is judged in log space: it is multiplicative and heavy-tailed (a
        # tiny model at a high learning rate has a p99 of 14x its median), the loss linearly.
        x = torch.stack([global_loss, grad_norm.clamp(min=1e-30).log()])

        n = self._count.clamp(max=self.cfg.spike_window)
        valid = torch.arange(self.cfg.spike_window, device=self.device) < n
        denom = n.clamp(min=2).float()
        mean = (self._hist * valid).sum(1) / n.clamp(min=1).float()
        var = (((self._hist - mean[:, None]) * valid) ** 2).sum(1) / (denom - 1)
        # A flat window is not 0 wide: at least 0.1% of the mean loss, a factor 1.001 of the norm.
        std = torch.maximum(var.sqrt(), self._floor * torch.stack([mean[0].abs(), mean[1] ** 0]))
        ready = self._count >= self.min_history
        spike = ready & (x > mean + self.cfg.spike_threshold * std) & ~(loss_bad | grad_bad)
        code = (
            loss_bad.long() * LOSS_NONFINITE
            + grad_bad.long() * GRAD_NONFINITE
            + spike[0].long() * LOSS_SPIKE
            + spike[1].long() * GRAD_SPIKE
        )
        if sdc is not None:  # every rank's verdict, to name the ones whose recompute differed
            verdicts = torch.zeros(self.world_size, 4, device=self.device)
            verdicts[self.rank] = sdc.float()
            if self.world_size > 1:
                dist.all_reduce(verdicts, op=dist.ReduceOp.SUM)
            code = code + (verdicts[:, :2].sum() > 0).long() * SDC
            self._sdc[len(self._steps)] = verdicts
        skip = (code > 0) | self._halted
        self._halted |= (code & self.halt_bits) > 0
        # Every finite step enters the window, spikes too: a lasting change of level is taken
        # in within a window, not flagged (and skipped) for ever.
        ok = ~(loss_bad | grad_bad)
        slot = (self._count % self.cfg.spike_window).reshape(1)
        kept = self._hist.index_select(1, slot)
        self._hist.index_copy_(1, slot, torch.where(ok, x.reshape(2, 1), kept))
        self._count += ok.long()

        logged_loss = torch.where(loss_bad, torch.full_like(global_loss, math.nan), global_loss)
        i = len(self._steps)
        if i >= CAPACITY:  # the trainer reads them when `full`: a caller that does not, errs
            raise RuntimeError("HealthGuard.check: records full; flush() them first")
        self._records[i] = torch.stack([
            logged_loss, grad_norm, code.float(), loss, skip.float(),
            mean[0], std[0], mean[1], std[1],
        ])  # fmt: skip
        self._steps.append(step)
        return skip.float(), logged_loss

    @property
    def full(self) -> bool:
        """The records are full: the host must read them before the next step."""
        return len(self._steps) >= CAPACITY

    # ------------------------------------------------------------------ host side
    def flush(self) -> list[Incident]:
        """Read the pending records (one host sync), report each incident, and raise
        ``HealthStop`` when the policy or the persistence of anomalies says stop; a rollback
        verdict is left in ``rollback`` for the trainer. Every rank calls it at the same
        steps."""
        if not self._steps:
            return []
        k = len(self._steps)
        rows = self._records[:k].tolist()
        steps, self._steps = self._steps, []
        sdc, self._sdc = {i: v.tolist() for i, v in self._sdc.items()}, {}
        anomalous = [i for i, r in enumerate(rows) if r[2]]
        own = [[r[3] for r in rows]]  # every rank's own loss, when some rank's was not finite
        if any(int(rows[i][2]) & LOSS_NONFINITE for i in anomalous) and self.world_size > 1:
            gathered = [torch.zeros(k, device=self.device) for _ in range(self.world_size)]
            dist.all_gather(gathered, self._records[:k, 3].contiguous())
            own = [g.tolist() for g in gathered]
        incidents: list[Incident] = []
        stop: Incident | None = None
        why = ""  # the stop line's reason
        for i, row in enumerate(rows):
            code, skipped = int(row[2]), bool(row[4])
            self.counts.skipped_steps += skipped
            if not code:
                if not skipped:
                    self._consecutive = 0
                continue
            self._consecutive += 1
            for bit, quantity, kind in _KINDS:
                if not code & bit:
                    continue
                ranks, value = None, row[0] if quantity == "loss" else row[1]
                if bit == LOSS_NONFINITE:  # the ranks whose own loss was bad, and the first value
                    bad = [(r, v[i]) for r, v in enumerate(own) if not math.isfinite(v[i])]
                    if len(own) == 1:  # one rank, or nothing gathered: this rank's own view
                        bad = [(self.rank, v) for _, v in bad]
                    ranks, value = [r for r, _ in bad], bad[0][1] if bad else value
                differs = None
                if bit == SDC:  # the ranks whose own loss differed; else whose gradients did
                    ranks, differs, value = _sdc_verdict(sdc[i])
                j = 5 if quantity == "loss" else 7
                action = self.action[bit]
                incident = Incident(
                    step=steps[i],
                    quantity=quantity,
                    kind=kind,
                    value=value,
                    action=action,
                    ranks=ranks,
                    mean=_shown(quantity, row[j]) if kind == "spike" else None,
                    std=_shown(quantity, row[j + 1]) if kind == "spike" else None,
                    differs=differs,
                )
                incidents.append(incident)
                if action == "stop" and stop is None:
                    stop, why = incident, f"health.{kind} = stop: stopped before applying it"
                if action == "rollback" and self.rollback is None:
                    self.rollback = incident
            if self.rollback is not None or stop is not None:
                break  # nothing after it was applied: the rest of the records are moot
            if self._consecutive >= self.cfg.max_consecutive:
                stop = incidents[-1]
                why = (
                    f"{self._consecutive} anomalous steps in a row (health.max_consecutive = "
                    f"{self.cfg.max_consecutive}): stopped, none of them applied"
                )
                break
        if stop is None and self.rollback is not None:
            blocked = self._blocked(self.rollback)
            if blocked is not None:
                stop, why = self.rollback, blocked
        if stop is not None:  # the stopping step's incidents say what was done: stop
            self.rollback = None
            for incident in incidents:
                if incident.step == stop.step:
                    incident.action = "stop"
        self._report(incidents)
        if stop is not None:
            raise HealthStop(f"{stop.line().split(' -> ')[0]}; {why}")
        return incidents

    def _blocked(self, incident: Incident) -> str | None:
        """The stop line's reason when a rollback for ``incident`` cannot be done, else None."""
        why = self.rollback_blocker(incident) if self.rollback_blocker is not None else None
        return None if why is None else f"{why}: stopped"

    def nonfinite_weights(self, step: int, counts: list[int]) -> None:
        """The weights are not finite at a save point (``counts``: every rank's non-finite
        tensors): an applied update overflowed, though its loss and gradient norm were finite.
        An update cannot be unapplied, so skipping is no remedy: under ``rollback`` the trainer
        rolls back (``rollback`` is set), under any other policy the run stops (``HealthStop``);
        either way nothing is saved. Reported as an incident of its own."""
        ranks = [r for r, n in enumerate(counts) if n]
        policy = self.cfg.nonfinite
        action = "rollback" if policy == "rollback" else "stop"
        incident = Incident(step, "weights", "nonfinite", float(max(counts)), action, ranks)
        why = "health.nonfinite = stop: stopped, nothing saved"
        if policy == "skip":  # the update is in the weights already: skipping cannot undo it
            why = (
                "an applied update made them so, which health.nonfinite = skip cannot undo: "
                "stopped, nothing saved"
            )
        if action == "rollback" and (blocked := self._blocked(incident)) is not None:
            incident.action, why = "stop", blocked
        self._report([incident])
        if incident.action == "stop":
            raise HealthStop(f"{incident.line().split(' -> ')[0]}; {why}")
        self.rollback = incident

    def _report(self, incidents: list[Incident]) -> None:
        for incident in incidents:
            self.counts.incidents += 1
            key = f"{incident.quantity}_{incident.kind}"
            self.counts.by_kind[key] = self.counts.by_kind.get(key, 0) + 1
            if self.is_rank0:
                logger.warning(incident.line())
        self._append([i.row() for i in incidents])

    def record_stragglers(self, found: list[Straggler]) -> None:
        """Report the ranks the straggler monitor named: one console line and one
        ``health.jsonl`` row each (reported only: a slow rank changes no update)."""
        if self.is_rank0:
            for s in found:
                logger.warning(s.line())
        self._append([s.row() for s in found])

    def _append(self, rows: list[dict[str, Any]]) -> None:
        if self.jsonl is not None and rows:
            if self._rows is None:
                self._rows = storage.LineLog(self.jsonl)
            self._rows.write("".join(json.dumps(r) + "\n" for r in rows))

    def record_replica_groups(self, step: int, events: list[tuple[str, int, str]]) -> None:
        """Record what the fault-tolerant replica groups went through (a group left or joined,
        a heal, a step redone): one ``health.jsonl`` row each (the console said it already)."""
        rows = [
            {"step": step, "quantity": "replica_groups", "kind": "replica_groups",
             "value": live, "action": what, "ranks": "all", "detail": line}
            for what, live, line in events
        ]  # fmt: skip
        self._append(rows)

    def record_rollback(
        self, line: str, step: int, target: int, skipped: tuple[int, int] | None
    ) -> None:
        """Report a rollback the trainer did: its console line and ``health.jsonl`` row."""
        self.counts.rollbacks += 1
        if self.is_rank0:
            logger.warning(line)
        row: dict[str, Any] = {"step": step, "action": "rollback", "to_step": target}
        if skipped is not None:
            row["skipped_samples"] = list(skipped)
        self._append([row])

    def metrics(self) -> dict[str, float]:
        """Cumulative counts for the metrics sinks (console, jsonl, MLflow)."""
        return {
            "health/incidents": float(self.counts.incidents),
            "health/skipped_steps": float(self.counts.skipped_steps),
            "health/rollbacks": float(self.counts.rollbacks),
        }

    def mark(self) -> dict[str, Any]:
        """The guard's part of the health mark of a checkpoint saved now (after a flush): it
        passed every update the checkpoint holds (the trainer adds ``healthy``: the weights are
        finite)."""
        return {
            "guard": True,
            "incidents": self.counts.incidents,
            "skipped_steps": self.counts.skipped_steps,
            "rollbacks": self.counts.rollbacks,
        }
