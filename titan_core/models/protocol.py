"""The model protocol: what a family registers so that the engine can build, parallelize, split,
convert, size and evaluate it without knowing it.

A family is a package (``titan_core.models.<family>`` or any importable module) exposing
``MODEL_SPEC = ModelSpec(...)``. Engine code reaches a family only through its spec (see
``titan_core.models.get_model_spec``); docs/models.md is the guide and checklist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from titan_core.config.job import Float8, JobConfig
    from titan_core.distributed.parallel_dims import ParallelDims
    from titan_core.distributed.pipeline_parallel import PipelineRunner
    from titan_core.models.common.pipeline import PipelinePlan

StateDict = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Shapes = Mapping[str, tuple[int, ...]]


def no_extra_tensors(found: Shapes, expected: Shapes, args: Any) -> dict[str, tuple[int, ...]]:
    """A family whose ``from_hf`` reads ``to_hf``'s names only."""
    return {}


def no_optional_part(name: str, args: Any) -> str | None:
    """A family every folder of which holds every tensor ``to_hf`` names."""
    return None


@dataclass(frozen=True)
class HFAdapter:
    """Native ⇄ Hugging Face ``transformers`` names, tensor layouts and config.

    ``to_hf``/``from_hf`` map whole or partial state dicts (a subset of keys maps to the
    corresponding subset; dcp-to-hf streams tensor by tensor), ``to_hf_config`` gives the
    ``config.json`` content (``architectures`` and ``model_type`` included), ``from_hf_config``
    the model args of a ``config.json`` (CheckpointError naming ``source`` when it cannot).
    ``extra_tensors`` and ``optional_part`` tell the check of a folder's tensors
    (``checkpoint.hf_weights.check_hf_weights``) what else it may hold and what it may lack.
    """

    architectures: tuple[str, ...]
    """``config.json`` ``architectures`` values this family reads (e.g. ``LlamaForCausalLM``)."""
    model_type: str
    to_hf: Callable[[StateDict, Any], StateDict]
    from_hf: Callable[[StateDict, Any], StateDict]
    to_hf_config: Callable[[Any], dict[str, Any]]
    from_hf_config: Callable[[dict[str, Any], str], Any]
    extra_tensors: Callable[[Shapes, Shapes, Any], dict[str, tuple[int, ...]]] = no_extra_tensors
    """``(found, expected, args)``: the tensors of a folder (``found``, name -> shape) that
    ``from_hf`` reads beyond ``to_hf``'s names (``expected``), each with the shape it must
    have: FP8 block scales it folds in, copies of shared weights it drops. Others are unknown."""
    optional_part: Callable[[str, Any], str | None] = no_optional_part
    """``(name, args)``: for one of ``to_hf``'s names, the part of the model it belongs to when
    a folder may lack that part whole (a layer ``transformers`` does not save), named for the
    warning; that part then keeps the model's initialization. None: every folder has it."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to build, parallelize, split, size and convert one family.

    ``parallelize(model, parallel_dims, cfg)`` applies TP/SP, AC, compile and FSDP in place;
    ``pipeline(model, parallel_dims, cfg, device, loss_fn, parallelize)`` splits the meta model
    into this rank's stages and returns (runner, parts); ``plan_pipeline(cfg, args, pp)`` is the
    stage split both of them and ``titan estimate`` use; ``tp_plan(model, loss_parallel,
    float8)`` the TP/SP styles by module name (estimation reads the sharded dims from it);
    ``check(parallel_dims, cfg, device_type, args)`` refuses unsupported settings with one
    ConfigError line before anything starts; ``nparams_and_flops(args, model, seq_len)`` the
    parameter count and training FLOPs per token; ``config_registry`` the module whose public
    functions are the family's recipes (``--module NAME --config FUNCTION``).
    """

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: Mapping[str, Any]
    parallelize: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module]
    pipeline: Callable[..., tuple[PipelineRunner, list[nn.Module]]]
    plan_pipeline: Callable[[JobConfig, Any, int], PipelinePlan]
    tp_plan: Callable[[nn.Module, bool, Float8], dict[str, ParallelStyle]]
    check: Callable[[ParallelDims, JobConfig, str, Any], None]
    nparams_and_flops: Callable[[Any, nn.Module, int], tuple[int, int]]
    hf: HFAdapter
    config_registry: str
    description: str = ""


def labels_ahead_depth(model: nn.Module) -> int:
    """How many targets past each position's own the model's training forward reads (0: none).
    A model that trains a loss of its own further ahead (multi-token prediction) says so with an
    ``mtp_depth`` attribute and takes ``labels_ahead=`` (``models.common.mtp.labels_ahead``'s
    (bs, seq, depth + 1)) besides the tokens."""
    return int(getattr(model, "mtp_depth", 0))


def decoder_spec(
    *,
    name: str,
    model_cls: type[nn.Module],
    args_cls: type,
    flavors: Mapping[str, Any],
    hf: HFAdapter,
    config_registry: str,
    description: str = "",
    tp_plan: Callable[..., dict[str, ParallelStyle]] | None = None,
) -> ModelSpec:
    """A spec for a family built on ``models.common.decoder``: the shared parallel plan,
    pipeline split, checks and FLOP count (``tp_plan`` replaces the shared TP plan)."""
    from titan_core.models.common.parallelize import (
        check_decoder_support,
        decoder_tp_plan,
        parallelize_decoder,
    )
    from titan_core.models.common.pipeline import pipeline_decoder, plan_decoder_pipeline

    plan = tp_plan or decoder_tp_plan

    def parallelize(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> nn.Module:
        return parallelize_decoder(model, parallel_dims, cfg, plan)

    return ModelSpec(
        name=name,
        model_cls=model_cls,
        args_cls=args_cls,
        flavors=flavors,
        parallelize=parallelize,
        pipeline=pipeline_decoder,
        plan_pipeline=plan_decoder_pipeline,
        tp_plan=plan,
        check=check_decoder_support,
        nparams_and_flops=lambda args, model, seq_len: args.get_nparams_and_flops(model, seq_len),
        hf=hf,
        config_registry=config_registry,
        description=description,
    )
