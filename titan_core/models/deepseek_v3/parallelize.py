"""DeepSeek-V3's tensor-parallel plan: the shared decoder plan (embedding, norms, dense and MoE
feed-forwards, output) with multi-head latent attention in place of GQA.

MLA under TP + SP, per block (as torchtitan splits it): the attention input is gathered along
the sequence; the per-head up-projections ``wq`` / ``wq_b`` and ``wkv_b`` are column-wise (each
rank computes its own heads), ``wo`` row-wise back to sequence shards. The low-rank down
projections ``wq_a`` / ``wkv_a`` and their norms ``q_norm`` / ``kv_norm`` are small and shared by
every head: they are computed whole on every TP rank (replicated parameters). Their output
gradients are full sums on every rank, because the column-wise ``wq_b`` / ``wkv_b`` all-reduce
their input gradient, except for the rotary key (``wkv_a``'s last ``qk_rope_head_dim``
channels): one key shared by the rank's local heads, whose gradient is a partial sum over the
TP ranks; ``SharedKeyParallel`` sums that slice in backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from titan_core.config.job import Float8 as Float8Config
from titan_core.distributed.tensor_parallel import ReplicateParallel
from titan_core.models.common.mla import MultiHeadLatentAttention
from titan_core.models.common.parallelize import decoder_tp_plan

__all__ = ["SharedKeyParallel", "deepseek_v3_tp_plan"]

# The decoder plan's GQA entries, replaced by MLA's below (``q_norm`` is MLA's latent norm).
_GQA = ("attention.wq", "attention.wk", "attention.wv", "attention.q_norm", "attention.k_norm")


class _SumTrailingGrad(torch.autograd.Function):
    """Identity in forward; in backward the gradient's channels from ``start`` on are summed
    over ``group`` (the others are already full sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: torch.distributed.ProcessGroup, start: int):  # type: ignore[override]
        ctx.group, ctx.start = group, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        grad = grad.clone()
        partial = grad[..., ctx.start :].contiguous()
        torch.distributed.all_reduce(partial, group=ctx.group)
        grad[..., ctx.start :] = partial
        return grad, None, None


class SharedKeyParallel(ReplicateParallel):
    """MLA's ``wkv_a`` under TP: replicated like ``ReplicateParallel``; the gradient of its
    trailing ``start:`` output channels (the rotary key every local head shares) is summed over
    the TP ranks in backward."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        group, start = device_mesh.get_group(), self.start

        def sum_key_grad(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            return _SumTrailingGrad.apply(out, group, start)

        module.register_forward_hook(sum_key_grad)
        return module


def mla_tp_plan(attention: MultiHeadLatentAttention, colwise: type) -> dict[str, ParallelStyle]:
    """One MLA module's styles, names relative to the block (``attention.*``)."""
    plan: dict[str, ParallelStyle] = {
        "attention.wkv_a": SharedKeyParallel(attention.kv_lora_rank),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": colwise(),
    }
    if attention.wq is not None:  # no query LoRA (Moonlight): queries straight from dim
        plan["attention.wq"] = colwise()
    else:
        plan["attention.wq_a"] = ReplicateParallel()
        plan["attention.q_norm"] = ReplicateParallel()
        plan["attention.wq_b"] = colwise()
    return plan


def deepseek_v3_tp_plan(
    model: nn.Module, loss_parallel: bool, float8_cfg: Float8Config
) -> dict[str, ParallelStyle]:
    """The decoder TP + SP plan with each block's attention planned as MLA (see the module
    doc); an MTP block's input norms, projection and head norm run on the sequence shards
    with replicated weights (``SequenceParallel``), as the decoder's norms do."""
    from titan_core.distributed.float8 import tp_styles

    colwise, _, _ = tp_styles(float8_cfg)
    plan = decoder_tp_plan(model, loss_parallel, float8_cfg)
    for name, block in model.layers.items():
        for fqn in _GQA:
            plan.pop(f"layers.{name}.{fqn}", None)
        mla = mla_tp_plan(block.attention, colwise)
        plan.update({f"layers.{name}.{fqn}": style for fqn, style in mla.items()})
        if hasattr(block, "mtp_input"):  # both inputs arrive as sequence shards
            for fqn in ("mtp_input.enorm", "mtp_input.hnorm", "mtp_input.eh_proj"):
                plan[f"layers.{name}.{fqn}"] = SequenceParallel(use_local_output=True)
            plan[f"layers.{name}.head_norm"] = SequenceParallel()  # into the output head
    return plan
