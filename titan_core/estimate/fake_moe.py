"""Mixture-of-experts layers on fake tensors (the estimator's profiles, the COMM_MODE dry run).

Which experts a token picks is data, and fake tensors have shapes only: ``torch.bincount`` of
the routed expert ids has no fake implementation, and every expert's row count is a
data-dependent size. Inside ``balanced_routing(model)`` every MoE layer of ``model`` runs its
own ``forward`` (router, sort, combine, aux loss, tensor-parallel hooks), with the routing
assumed balanced: each expert gets an equal share of the routed rows (tokens x top_k / E, the
remainder spread over the first experts). Under expert parallelism the rows go through the
real all-to-all (``distributed.expert_parallel.all_to_all``) with the even splits a balanced
routing gives. Outside fake tensors nothing changes (real tensors take the real paths).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from titan_core.models.common.moe import MoE, local_dispatch


def even_splits(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes differing by at most one (the first ones larger)."""
    base, rem = divmod(total, parts)
    return [base + (i < rem) for i in range(parts)]


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _balanced_experts(experts: nn.Module) -> Any:
    """``GroupedExperts.forward`` with each local expert taking an even share of the rows: the
    exact per-expert loop, sized from the input's shape (FSDP's hooks still gather the
    weights: this replaces ``forward``, not ``__call__``)."""

    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = _local(experts.w1), _local(experts.w2), _local(experts.w3)
        outs = []
        for e, rows in enumerate(torch.split(x, even_splits(x.shape[0], w1.shape[0]))):
            h = F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e])
            outs.append(F.linear(h, w2[e]))
        return torch.cat(outs, dim=0)

    return forward


def _balanced_dispatcher(dispatcher: Any) -> Any:
    """The expert-parallel dispatcher's exchange with balanced splits: each rank sends the same
    number of rows to every ep rank and receives as many back."""
    from titan_core.distributed.expert_parallel import all_to_all

    def dispatch(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        splits = even_splits(x.shape[0], dispatcher.ep)
        rows = all_to_all(x, splits, splits, dispatcher.group)
        y = experts(rows, counts)
        return all_to_all(y, splits, splits, dispatcher.group)

    return dispatch


def _bincount(original: Any) -> Any:
    def bincount(ids: torch.Tensor, weights: Any = None, minlength: int = 0) -> torch.Tensor:
        if not is_fake(ids):
            return original(ids, weights, minlength)
        n = max(minlength, 1)
        return torch.tensor(even_splits(ids.numel(), n), dtype=torch.int64, device=ids.device)

    return bincount


@contextlib.contextmanager
def balanced_routing(model: nn.Module) -> Iterator[int]:
    """Run ``model``'s MoE layers on fake tensors with balanced routing (see the module doc);
    yields how many MoE layers it set up. Restores everything on exit."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        yield 0
        return
    saved = []
    for moe in layers:
        saved.append((moe, moe.dispatcher, moe.experts.__dict__.get("forward")))
        moe.experts.forward = _balanced_experts(moe.experts)
        if moe.dispatcher is not local_dispatch and hasattr(moe.dispatcher, "group"):
            moe.dispatcher = _balanced_dispatcher(moe.dispatcher)
    original = torch.bincount
    torch.bincount = _bincount(original)
    try:
        yield len(layers)
    finally:
        torch.bincount = original
        for moe, dispatcher, forward in saved:
            moe.dispatcher = dispatcher
            if forward is None:
                del moe.experts.forward
            else:
                moe.experts.forward = forward
