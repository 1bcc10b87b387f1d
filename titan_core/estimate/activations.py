"""Activation memory and FLOPs of one transformer block and of the output head, measured by
running them on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage).

The block runs through the trainer's own code: the model's ``TransformerBlock`` with TP-local
weight shapes, wrapped by ``apply_activation_checkpointing`` for the configured AC mode, under the
trainer's dtype policy. A dispatch mode follows every storage that an op creates until it is
freed, which gives what stays alive from forward to backward and the peak during backward; a
second run under ``FlopCounterMode`` counts the FLOPs, recomputation included.

Mixture-of-experts blocks run with balanced routing (each expert gets tokens x top_k / E rows):
which expert a token picks is data, and fake tensors have no data (``fake_moe``).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

from titan_core.components.loss import cross_entropy_loss
from titan_core.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_core.distributed.context_parallel import pad_values_to_query_head_size
from titan_core.estimate.fake_moe import balanced_routing
from titan_core.estimate.layout import Layout, tp_local_shape


def _cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flops(grad: Any, query: Any, key: Any, value: Any, *a: Any, **k: Any) -> int:
    return sdpa_backward_flop_count(grad, query, key, value)


# FlopCounterMode knows the CUDA attention kernels only; on CPU, SDPA runs this op pair.
_CPU_SDPA = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self, external: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes = WeakIdKeyDictionary()
        for t in external:  # allocated before tracking: views of them are no new memory
            self._sizes[t.untyped_storage()] = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size


@dataclass(frozen=True)
class PartProfile:
    """Memory (bytes) and FLOPs of one part for one microbatch on one rank."""

    saved_bytes: int
    """Kept alive from its forward to its backward, its input included if it keeps it."""
    backward_extra_bytes: int
    """Peak during its backward above what is alive when backward starts (saved bytes and
    output): incoming gradient, recomputation, parameter gradients, temporaries."""
    param_grad_bytes: int
    """Gradients of its parameters in the compute dtype, before any reduction."""
    input_bytes: int
    forward_flops: int
    backward_flops: int
    """Backward FLOPs, recomputation under activation checkpointing included."""


def _fake_params(
    module: nn.Module, dtype: torch.dtype, tp: int, shard_dims: Mapping[str, int]
) -> None:
    """Replace every parameter by a fake one of its TP-local shape in ``dtype``; ``shard_dims``
    gives the TP-sharded dim by parameter name relative to ``module``."""
    for prefix, mod in module.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                fqn = f"{prefix}.{name}".replace(_CHECKPOINT_PREFIX, "").removeprefix(".")
                shape = tp_local_shape(tuple(p.shape), shard_dims.get(fqn), tp)
                mod._parameters[name] = nn.Parameter(torch.empty(shape, dtype=dtype))


def _ep_local_experts(module: nn.Module, ep: int) -> None:
    """Give every MoE in ``module`` (fake parameters already) only the experts one ep rank
    holds (with balanced routing: the same rows on fewer, fuller experts) and fake buffers."""
    from titan_core.models.common.moe import MoE

    for mod in module.modules():
        if isinstance(mod, MoE):
            for name, p in list(mod.experts._parameters.items()):
                shape = (mod.args.num_experts // ep, *p.shape[1:])
                mod.experts._parameters[name] = nn.Parameter(torch.empty(shape, dtype=p.dtype))
            for name, b in list(mod._buffers.items()):  # expert bias, token counts: fake too
                if b is not None:
                    mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _forward(
    forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, autocast: torch.dtype | None
) -> torch.Tensor:
    if autocast is None:
        return forward(x)
    with torch.autocast("cpu", dtype=autocast):
        return forward(x)


def _profile(
    module: nn.Module,
    x: torch.Tensor,
    others: list[torch.Tensor],
    forward: Callable[[torch.Tensor], torch.Tensor],
    autocast: torch.dtype | None,
) -> PartProfile:
    """Run ``forward(x)`` and its backward twice (inside a FakeTensorMode): once for memory,
    once for FLOPs, because FlopCounterMode's module hooks keep tensors alive for longer."""
    params = list(module.parameters())
    tracker = _LiveBytes([x, *others, *params])
    with tracker:
        # A tracked non-leaf input, like the previous part's output: it stays alive only if this
        # part keeps it (a bf16 input that RMSNorm upcasts is not itself saved).
        h = x.clone()
        out = _forward(forward, h, autocast)
        del h
        # The output is the next part's input: counted there, if that part keeps it.
        saved = tracker.live - _nbytes(out)
        start = tracker.peak = tracker.live
        out.backward(torch.ones_like(out))
        grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    for p in params:
        p.grad = None
    flops = FlopCounterMode(display=False, custom_mapping=_CPU_SDPA)
    with flops:
        out = _forward(forward, x, autocast)
        forward_flops = flops.get_total_flops()
        out.backward(torch.ones_like(out))
    return PartProfile(
        saved_bytes=saved,
        backward_extra_bytes=tracker.peak - start,
        param_grad_bytes=grads,
        input_bytes=_nbytes(x),
        forward_flops=forward_flops,
        backward_flops=flops.get_total_flops() - forward_flops,
    )


def _hidden(layout: Layout, batch: int, seq: int) -> torch.Tensor:
    """The fake hidden state entering a block, in the dtype the trainer's embedding produces."""
    dim = layout.model_args.dim
    return torch.empty(batch, seq, dim, dtype=layout.param_dtype, requires_grad=True)


def profile_block(
    layout: Layout, name: str, block: nn.Module, ac_mode: str, batch: int
) -> PartProfile:
    """Block ``name`` (``layers.0``) at TP-local shapes on ``batch`` sequences; ``ac_mode``:
    none, full or op."""
    args, seq = layout.model_args, layout.local_seq
    prefix = f"{name}."
    shard_dims = {
        k.removeprefix(prefix): d for k, d in layout.tp_shard_dims.items() if k.startswith(prefix)
    }
    block = copy.deepcopy(block)
    if ac_mode != "none":
        ac = layout.cfg.activation_checkpoint
        mode = "full" if ac_mode == "full" else "selective"
        wrapped = nn.ModuleDict({"0": block})
        apply_activation_checkpointing(
            wrapped, dataclasses.replace(ac, mode=mode, selective_ac_option="op")
        )
        block = wrapped["0"]
    # Values narrower than queries (MLA) would send CPU SDPA down its math path, which keeps
    # the whole score matrix: pad them so that a fused kernel runs, as on GPUs.
    with FakeTensorMode(), pad_values_to_query_head_size():
        _fake_params(block, layout.param_dtype, layout.dims.tp, shard_dims)
        _ep_local_experts(block, layout.dims.ep)
        freqs = torch.empty(seq, args.head_dim // 2, dtype=torch.complex64)
        x = _hidden(layout, batch, seq)
        with balanced_routing(block):
            return _profile(block, x, [freqs], lambda h: block(h, freqs), layout.autocast_dtype)


def profile_head(layout: Layout, norm: nn.Module, output: nn.Module, batch: int) -> PartProfile:
    """Final norm, output projection and the trainer's float32 cross-entropy loss."""
    head = nn.ModuleDict({"norm": copy.deepcopy(norm), "output": copy.deepcopy(output)})
    seq = layout.local_seq
    with FakeTensorMode():
        _fake_params(head, layout.param_dtype, layout.dims.tp, layout.tp_shard_dims)
        if layout.local_vocab != head["output"].weight.shape[0]:  # loss parallel off: gathered
            head["output"].weight = nn.Parameter(
                torch.empty(layout.local_vocab, layout.model_args.dim, dtype=layout.param_dtype)
            )
        labels = torch.empty(batch, seq, dtype=torch.int64)
        x = _hidden(layout, batch, seq)

        def forward(h: torch.Tensor) -> torch.Tensor:
            return cross_entropy_loss(head["output"](head["norm"](h)), labels)

        return _profile(head, x, [labels], forward, layout.autocast_dtype)


def profile_norm(layout: Layout, norm: nn.Module, batch: int) -> PartProfile:
    """One RMSNorm: sequence parallelism splits what it saves over tp."""
    norm = copy.deepcopy(norm)
    with FakeTensorMode():
        _fake_params(norm, layout.param_dtype, 1, {})
        x = _hidden(layout, batch, layout.local_seq)
        return _profile(norm, x, [], norm, layout.autocast_dtype)


def saved_with_sequence_parallel(
    profile: PartProfile, ac_mode: str, norm: PartProfile | None, tp: int, num_norms: int
) -> int:
    """Saved bytes under TP with sequence parallelism: norms and block inputs hold 1/tp of the
    sequence; everything between the all-gather and the reduce-scatter is TP-local already."""
    if tp == 1 or norm is None:
        return profile.saved_bytes
    if ac_mode == "full":
        return profile.input_bytes // tp
    if ac_mode == "op":
        return profile.saved_bytes - profile.input_bytes * (tp - 1) // tp
    return profile.saved_bytes - num_norms * norm.saved_bytes * (tp - 1) // tp


def layer_kind(layout: Layout, index: int) -> str:
    """How layer ``index`` is checkpointed: none, full or op (mirrors the trainer's AC)."""
    ac = layout.cfg.activation_checkpoint
    if ac.mode == "none":
        return "none"
    if ac.mode == "full":
        return "full"
    if ac.selective_ac_option == "op":
        return "op"
    return "full" if (index + 1) % int(ac.selective_ac_option) == 0 else "none"


@dataclass(frozen=True)
class Profiles:
    """Measured parts for a layout: blocks by checkpointing kind, the head, and one norm."""

    blocks: dict[str, PartProfile]
    head: PartProfile
    norm: PartProfile | None
    """One RMSNorm, measured only under TP for the sequence-parallel correction."""

    def block_saved(self, kind: str, tp: int) -> int:
        """Bytes one block of ``kind`` keeps for backward on one TP rank."""
        return saved_with_sequence_parallel(self.blocks[kind], kind, self.norm, tp, 2)

    def head_saved(self, tp: int) -> int:
        """Bytes the head keeps for backward (log-probabilities included) on one TP rank."""
        return saved_with_sequence_parallel(self.head, "none", self.norm, tp, 1)


def profile_layout(layout: Layout) -> Profiles:
    """Measure every block kind the config uses, the head, and (under TP) one norm."""
    model, batch = layout.model, layout.microbatch_size
    kinds = {layer_kind(layout, i) for i in range(layout.model_args.n_layers)} | {"none"}
    # The first MoE block where there is one (DeepSeek-V3: 3 dense then 58 MoE layers),
    # else the first block: one profile stands for every layer.
    moe = [
        k for k in model.layers if layout.moe is not None and layout.model_args.moe_layer(int(k))
    ]
    key = moe[0] if moe else next(iter(model.layers))
    first, name = model.layers[key], f"layers.{key}"
    blocks = {kind: profile_block(layout, name, first, kind, batch) for kind in sorted(kinds)}
    head = profile_head(layout, model.norm, model.output, batch)
    norm = profile_norm(layout, model.norm, batch) if layout.dims.tp > 1 else None
    return Profiles(blocks=blocks, head=head, norm=norm)
