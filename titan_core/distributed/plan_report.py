"""What one rank's parallel plan turned out to be, read back from the parallelized model.

Nothing here knows how the plan was built: the mesh comes from ``ParallelDims``, and per module
the FSDP units, activation-checkpoint wrappers, compiled blocks, tensor-parallel styles (from
their hooks) and each parameter's global shape, local shard and placement per mesh dim are
inspected. Repeated transformer blocks collapse into one row (``layers.{0-79}``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan_core.distributed.parallel_dims import ParallelDims

_DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_FLATTENED = ("dp", "dp_shard_cp", "dp_cp", "ep")
# Wrapper attributes that do not belong in a user-facing module name.
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.?")
_LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class ModuleRow:
    """One module (or a group of identical blocks): what was applied and how its own
    parameters are laid out on this rank."""

    name: str
    applied: str
    params: str


def mesh_lines(dims: ParallelDims, world_size: int, pipeline: Any = None) -> list[str]:
    """The degrees, the device mesh with its flattened views, and the pipeline on this rank."""
    degrees = " × ".join(f"{n} {getattr(dims, n)}" for n in _DEGREES)
    ep = getattr(dims, "ep", 1)
    lines = [
        f"world {world_size} = {degrees}"
        + (f"; ep {ep} (carved from dp_shard × cp)" if ep > 1 else "")
    ]
    if world_size > 1:
        mesh = dims.mesh
        names = mesh.mesh_dim_names or ()
        shape = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
        flat = []
        for name in _FLATTENED:
            try:
                flat.append(f"{name}={mesh[name].size()}")
            except (KeyError, RuntimeError, ValueError):
                continue
        coord = mesh.get_coordinate() or []
        where = ", ".join(f"{n}={c}" for n, c in zip(names, coord, strict=False))
        lines.append(
            f"device mesh ({shape}); flattened views: {', '.join(flat) or 'none'}; "
            f"this rank (0) sits at {where}"
        )
    if pipeline is not None:
        stages = [s.stage_index for s in pipeline.stages]
        lines.append(
            f"pipeline: {type(pipeline.schedule).__name__}, {pipeline.stages[0].num_stages} "
            f"stages, {pipeline.num_microbatches} microbatches; this rank runs stage(s) {stages}"
        )
    return lines


def module_rows(
    parts: Sequence[nn.Module], stage_ids: Sequence[int] | None = None
) -> list[ModuleRow]:
    """Per module of every model part, grouped across identical transformer blocks."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, part in enumerate(parts):
        prefix = f"[stage {stage_ids[i]}] " if stage_ids and len(parts) > 1 else ""
        for raw_name, module in part.named_modules():
            name = _WRAPPERS.sub("", raw_name).rstrip(".") or "(root)"
            applied, params = _applied(module), _params(module)
            if not applied and not params:
                continue
            match = _LAYER.search(name)
            index = int(match.group(2)) if match else -1
            canonical = _LAYER.sub(r"\1layers.*", name) if match else name
            groups.setdefault((prefix + canonical, applied, params), []).append(index)
    rows = []
    for (name, applied, params), indices in groups.items():
        if indices[0] >= 0:
            name = name.replace("layers.*", f"layers.{{{_ranges(sorted(set(indices)))}}}", 1)
        rows.append(ModuleRow(name, applied, params))
    return rows


def _applied(module: nn.Module) -> str:
    tags = []
    if isinstance(module, FSDPModule):
        tags.append("FSDP unit")
    kind = type(module).__name__
    if kind == "CheckpointWrapper":
        tags.append("activation checkpoint")
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        tags.append("torch.compile")
    tags.extend(_tp_styles(module))
    return ", ".join(tags)


def _tp_styles(module: nn.Module) -> list[str]:
    """Tensor-parallel styles applied to ``module``, recognized from the hooks they installed."""
    styles: list[str] = []
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    for hook in hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, ParallelStyle):
                name = type(value).__name__
            elif isinstance(value, functools.partial) and "Parallel" in value.func.__qualname__:
                name = value.func.__qualname__.split(".")[0]
            else:
                continue
            if name not in styles:
                styles.append(name)
    return styles


def _params(module: nn.Module) -> str:
    out = []
    for name, param in module.named_parameters(recurse=False):
        shape = list(param.shape)
        if isinstance(param, DTensor):
            local = list(param.to_local().shape)
            names = param.device_mesh.mesh_dim_names or ()
            where = " ".join(f"{p}@{n}" for p, n in zip(param.placements, names, strict=False))
            out.append(f"{name} {shape} → {local} {where}")
        else:
            out.append(f"{name} {shape} (whole on every rank)")
    return "; ".join(out)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
