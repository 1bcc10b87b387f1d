"""Per-step mixture-of-experts bookkeeping for the trainer: the aux-loss gradient scale, the
loss-free bias update and the expert-load metrics.

Every MoE layer counts the tokens it routes on this rank (``MoE.tokens_per_expert``). After each
optimizer step the counts of this rank's layers are stacked into one (layers, E) tensor and
summed over the data x context parallel ranks (never tp: TP ranks route the same tokens) with a
single all-reduce; the sum is the whole batch's load, which drives ``MoE.update_bias`` (a no-op
unless loss-free balancing is on) and, on log steps, the metrics. Without loss-free balancing the
all-reduce runs on log steps only. Under pipeline parallelism each stage holds other layers: on
log steps a fixed (n_layers, E) tensor, zeros for the layers a stage lacks, is summed over the
pp group too, so rank 0 reports every layer.

Metrics (see ``docs/moe.md``): ``moe/aux_loss`` (mean over layers, microbatches and ranks of the
load-balancing loss before its coefficient; ``top_k`` for a perfectly balanced router),
``moe/load_max`` / ``moe/load_min`` (max / min over experts of count / mean count, worst layer),
``moe/load_entropy`` (normalised entropy of the counts, mean over layers; 1 is uniform) and
``moe/layer{i}/load_max|load_min|load_entropy``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.models.common.moe import MoE, moe_layers


def _in_backward() -> bool:
    """True during autograd's backward: a forward run then is activation checkpointing's
    recompute, whose aux loss is the same one again."""
    return torch._C._current_graph_task_id() != -1


def _layer_index(name: str) -> int:
    """``layers.3`` (or a wrapped ``layers.3._checkpoint_wrapped_module``) -> 3."""
    match = re.search(r"(?:^|\.)layers\.(\d+)", name)
    assert match, f"an MoE layer outside model.layers: {name}"
    return int(match.group(1))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def load_metrics(counts: list[float]) -> tuple[float, float, float]:
    """(max / mean, min / mean, normalised entropy in [0, 1]) of one layer's expert counts;
    (1, 1, 1) when the layer routed nothing."""
    total = sum(counts)
    if total <= 0:
        return 1.0, 1.0, 1.0
    mean = total / len(counts)
    entropy = -sum(c / total * math.log(c / total) for c in counts if c > 0)
    norm = entropy / math.log(len(counts)) if len(counts) > 1 else 1.0
    return max(counts) / mean, min(counts) / mean, norm


class MoEStats:
    """The MoE layers of this rank's model parts and their per-step statistics."""

    def __init__(
        self,
        model: nn.Module,
        model_args: Any,
        group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | None = None,
    ) -> None:
        moe_args = getattr(model_args, "moe", None)
        self.num_experts = moe_args.num_experts if moe_args is not None else 0
        self.layers: dict[int, MoE] = {
            _layer_index(name): m for name, m in moe_layers(model).items()
        }
        # Blocks numbered past n_layers (multi-token prediction modules) get rows of their own.
        self.n_layers = max(
            int(getattr(model_args, "n_layers", 0)), max(self.layers, default=-1) + 1
        )
        # From the model's args, not this rank's layers: under PP a stage may hold no MoE layer
        # and must still join the pp-wide reduction of the log steps.
        self.enabled = moe_args is not None
        self.load_balance_bias = self.enabled and moe_args.load_balance_bias
        self.group = group
        self.pp_group = pp_group
        self.device = device or torch.device("cpu")
        self._aux: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        for i, layer in self.layers.items():
            layer.register_forward_hook(self._hook(i))

    def _hook(self, index: int) -> Any:
        def record(module: MoE, args: Any, out: Any) -> None:
            if (
                module.training
                and module.args.aux_loss_coef > 0
                and torch.is_grad_enabled()
                and not _in_backward()
                and module.aux_loss is not None
            ):
                self._aux[index].append(_local(module.aux_loss).float())

        return record

    def exclude_forwards_of(self, obj: Any, method: str) -> None:
        """Leave the forwards run inside ``obj.method`` out of the counts and the aux-loss
        average (a pipeline stage's shape inference: one forward at the first step, on the first
        microbatch or on uninitialised activations)."""
        if not self.layers:
            return
        original = getattr(obj, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            saved = {
                i: (m.tokens_per_expert.clone(), len(self._aux[i])) for i, m in self.layers.items()
            }
            try:
                return original(*args, **kwargs)
            finally:
                for i, (counts, n) in saved.items():
                    self.layers[i].tokens_per_expert.copy_(counts)
                    del self._aux[i][n:]

        setattr(obj, method, wrapped)

    def start_step(self, aux_loss_scale: float) -> None:
        """Before a step's first forward: zero the counts (validation forwards count too) and set
        the factor of each forward's aux-loss gradient, the one its training loss gets."""
        for layer in self.layers.values():
            layer.reset_load()
            layer.aux_loss_scale = aux_loss_scale
        for values in self._aux.values():
            values.clear()

    def end_step(self, log: bool) -> dict[str, float]:
        """After the optimizer step: loss-free bias update from the batch-wide counts, and on
        ``log`` steps the metrics (empty dict otherwise, or when the model has no MoE)."""
        if not self.enabled or not (log or self.load_balance_bias):
            return {}
        ids = sorted(self.layers)
        reduced = None
        if ids:  # (local layers, E + 2): counts, aux-loss sum, aux-loss count
            rows = []
            for i in ids:
                counts, aux = _local(self.layers[i].tokens_per_expert).float(), self._aux[i]
                aux_sum = torch.stack(aux).sum().reshape(1) if aux else counts.new_zeros(1)
                aux_n = counts.new_full((1,), float(len(aux)))
                rows.append(torch.cat([counts, aux_sum.to(counts.device), aux_n]))
            reduced = torch.stack(rows)
            if self.group is not None:
                dist.all_reduce(reduced, group=self.group)
            for j, i in enumerate(ids):
                self.layers[i].update_bias(reduced[j, : self.num_experts])
        if not log:
            return {}
        device = reduced.device if reduced is not None else self.device
        full = torch.zeros(self.n_layers, self.num_experts + 2, device=device)
        if reduced is not None:
            full[torch.tensor(ids, device=device)] = reduced
        if self.pp_group is not None:
            dist.all_reduce(full, group=self.pp_group)
        return self._metrics(full.cpu().tolist())

    def _metrics(self, rows: list[list[float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        per_layer: list[tuple[float, float, float]] = []
        aux: list[float] = []
        for i, row in enumerate(rows):
            counts, aux_sum, aux_n = row[: self.num_experts], row[-2], row[-1]
            if sum(counts) <= 0:  # a dense layer (or one that saw no token)
                continue
            hi, lo, ent = load_metrics(counts)
            per_layer.append((hi, lo, ent))
            out[f"moe/layer{i}/load_max"] = hi
            out[f"moe/layer{i}/load_min"] = lo
            out[f"moe/layer{i}/load_entropy"] = ent
            if aux_n > 0:
                aux.append(aux_sum / aux_n)
        if not per_layer:
            return {}
        head = {
            "moe/load_max": max(m[0] for m in per_layer),
            "moe/load_min": min(m[1] for m in per_layer),
            "moe/load_entropy": sum(m[2] for m in per_layer) / len(per_layer),
        }
        if aux:
            head = {"moe/aux_loss": sum(aux) / len(aux), **head}
        return {**head, **out}
