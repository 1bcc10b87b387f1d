"""Mixture-of-experts feed-forward: a top-k router (optionally group-limited, as DeepSeek-V3's),
routed experts stored as stacked weights, optional shared experts, and load balancing (the
Switch/Qwen3-MoE auxiliary loss and DeepSeek-V3's loss-free expert bias).

Dispatch is capacity-free: every token reaches all of its top-k experts. Tokens are sorted by
expert and the experts run as one grouped GEMM (``torch.nn.functional.grouped_mm``) or as an
exact per-expert loop. Where the experts live is the ``dispatcher``'s business: the default
runs every expert on this rank; expert parallelism (``distributed.expert_parallel``) swaps in
one that sends each token to the rank holding its expert with an all-to-all and back.

Native names (what the parallel plans, checkpoints and HF adapters key on), for a layer's
``moe``: ``router.gate.weight`` (E, dim); ``experts.w1`` and ``experts.w3`` (E, hidden, dim),
``experts.w2`` (E, dim, hidden) -- each expert's slice is an ``nn.Linear`` weight;
``shared_experts.w{1,2,3}.weight`` (a ``FeedForward``); the ``expert_bias`` buffer (E,).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.errors import ConfigError
from titan_core.models.common.feed_forward import FeedForward


@dataclass
class MoEArgs:
    """Shape and routing hyper-parameters of one mixture-of-experts feed-forward."""

    num_experts: int = 8
    """Routed experts (HF ``num_experts``)."""
    top_k: int = 2
    """Experts each token is sent to (HF ``num_experts_per_tok``)."""
    hidden_dim: int = 256
    """Hidden size of each routed expert's SwiGLU (HF ``moe_intermediate_size``)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Qwen3-MoE, Mixtral) or a sigmoid per expert
    (DeepSeek-V3)."""
    route_norm: bool = True
    """Renormalise each token's top-k weights to sum to 1 (HF ``norm_topk_prob``)."""
    route_scale: float = 1.0
    """Factor on the (normalised) top-k weights."""
    num_shared_experts: int = 0
    """Always-on experts every token goes through (DeepSeek, Qwen2-MoE); 0 for Qwen3-MoE."""
    shared_hidden_dim: int = 0
    """Total hidden size of the shared experts; 0 means ``num_shared_experts * hidden_dim``."""
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss (HF ``router_aux_loss_coef``); 0 turns it off."""
    load_balance_bias: bool = False
    """DeepSeek-V3's loss-free balancing: a per-expert bias added to the scores for selection
    only, nudged after every step towards equal loads."""
    bias_update_rate: float = 1e-3
    """Step of the loss-free bias update."""
    num_groups: int = 1
    """Expert groups for group-limited routing (HF ``n_group``); 1 routes over all experts."""
    top_groups: int = 1
    """Groups each token may use (HF ``topk_group``): the groups whose two best selection
    scores sum highest; the experts of the others are out of the token's top-k."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(
                f"model.moe.num_experts: expected an int >= 1, got {self.num_experts}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"model.moe.top_k: {self.top_k} must be between 1 and num_experts "
                f"({self.num_experts})"
            )
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError(
                f"model.moe.score_func: expected 'softmax' or 'sigmoid', got {self.score_func!r}"
            )
        if self.hidden_dim < 1:
            raise ConfigError(f"model.moe.hidden_dim: expected an int >= 1, got {self.hidden_dim}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ConfigError(
                f"model.moe.num_groups: {self.num_groups} must be >= 1 and divide num_experts "
                f"({self.num_experts})"
            )
        if not 1 <= self.top_groups <= self.num_groups:
            raise ConfigError(
                f"model.moe.top_groups: {self.top_groups} must be between 1 and num_groups "
                f"({self.num_groups})"
            )
        if self.top_groups < self.num_groups and self.top_k > self.top_groups * (
            self.num_experts // self.num_groups
        ):
            raise ConfigError(
                f"model.moe.top_k: {self.top_k} is more than the experts of {self.top_groups} "
                f"of {self.num_groups} groups"
            )

    @property
    def shared_dim(self) -> int:
        """Hidden size of the shared experts' one SwiGLU (0 when there are none)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_hidden_dim or self.num_shared_experts * self.hidden_dim

    def num_params(self, dim: int) -> tuple[int, int]:
        """(total, activated per token) parameters of one MoE feed-forward of width ``dim``."""
        router = self.num_experts * dim
        expert = 3 * dim * self.hidden_dim
        shared = 3 * dim * self.shared_dim
        return (
            router + self.num_experts * expert + shared,
            router + self.top_k * expert + shared,
        )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's, where it is on for ``x``'s device."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return torch.get_autocast_dtype(device)
    return x.dtype


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Whether the grouped GEMM is the default for ``x``: CUDA, computing in bf16 (bf16 tensors,
    or bf16 autocast; the fused kernels). Other devices and dtypes take the exact per-expert
    loop."""
    return x.is_cuda and _compute_dtype(x) == torch.bfloat16


def _local(w: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor: this rank's experts (and TP slice) of a sharded one."""
    return w.to_local() if isinstance(w, DTensor) else w


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights.

    ``forward(x, counts)`` takes tokens grouped by expert (``counts[e]`` rows for the e-th
    expert held here, in order) and returns each row through its expert. Under expert
    parallelism the weights are DTensors sharded on dim 0 and this rank computes only its
    ``num_local`` experts; under tensor parallelism the hidden dim is sharded too and the output
    is a partial sum over the TP ranks.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.grouped_mm: bool | None = None
        """True/False forces the grouped GEMM / the loop; None picks by device
        (``use_grouped_mm``)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(rows, dim) grouped by expert, ``counts`` (local experts,) int -> (rows, dim)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        grouped = self.grouped_mm if self.grouped_mm is not None else use_grouped_mm(x)
        if grouped:
            return _experts_grouped(x, counts, w1, w2, w3)
        return _experts_loop(x, counts, w1, w2, w3)

    def init_weights(self, init_std: float) -> None:
        """``w1`` at std 0.02; ``w2`` and ``w3`` at the depth-scaled ``init_std``, as
        ``FeedForward``."""
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)


def _experts_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """Each expert's rows through its own three matmuls: exact on every device."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
        h = F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e])
        outs.append(F.linear(h, w2[e]))
    if not outs:
        return x.new_zeros(x.shape[0], w2.shape[1])
    return torch.cat(outs, dim=0)


def _experts_grouped(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """All experts in three grouped GEMMs; ``offs`` are the groups' end rows (no host sync).

    The grouped GEMM is not on autocast's list, so under bf16 autocast (one GPU, no FSDP) the
    float32 tokens and master weights are cast here, as autocast casts them for ``F.linear``;
    under FSDP's bf16 parameters the casts are no-ops."""
    dtype = _compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return F.grouped_mm(h, w2.transpose(-2, -1), offs=offs)


class Router(nn.Module):
    """Top-k token-to-expert router: ``gate`` scores every expert for every token."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.args = args

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, dim) -> (scores (tokens, E) fp32, expert ids (tokens, k), weights (tokens, k)
        in ``x``'s dtype). ``expert_bias`` shifts the selection only, never the weights."""
        logits = self.gate(x).float()
        if self.args.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        select = scores if expert_bias is None else scores + expert_bias
        if self.args.top_groups < self.args.num_groups:
            select = self._limit_groups(select)
        _, expert_ids = torch.topk(select, self.args.top_k, dim=-1)
        weights = scores.gather(-1, expert_ids)
        if self.args.route_norm:
            denominator = weights.sum(dim=-1, keepdim=True)
            if self.args.score_func == "sigmoid":
                denominator = denominator + 1e-20
            weights = weights / denominator
        weights = weights * self.args.route_scale
        return scores, expert_ids, weights.to(x.dtype)

    def _limit_groups(self, select: torch.Tensor) -> torch.Tensor:
        """``select`` (tokens, E) with the experts outside each token's ``top_groups`` best
        groups set to -inf; a group's score is the sum of its two best selection scores
        (DeepSeek-V3, as transformers' ``DeepseekV3TopkRouter``)."""
        groups, top = self.args.num_groups, self.args.top_groups
        grouped = select.view(select.shape[0], groups, -1)  # (tokens, groups, E / groups)
        best = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)  # (tokens, groups)
        chosen = torch.topk(group_scores, top, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(select)

    def init_weights(self) -> None:
        """Gate at std 0.02."""
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=0.02)


class TokenDispatcher(Protocol):
    """Runs tokens sorted by expert through ``experts``, wherever the experts live."""

    def __call__(
        self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """``x`` (rows, dim) sorted by global expert id, ``counts`` (E,) -> outputs, same order."""
        ...


def local_dispatch(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert is on this rank: no communication."""
    return experts(x, counts)


class _ScaleGradientAdder(torch.autograd.Function):
    """Identity on ``out``; in backward also feeds ``coef`` into ``aux``'s graph, so the aux loss
    trains the router wherever the layer runs (pipeline stages and recompute included) without
    the training loss having to carry it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:  # type: ignore[override]
        ctx.coef = coef
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        aux_grad = torch.full(ctx.aux_shape, ctx.coef, dtype=torch.float32, device=grad.device)
        return grad, aux_grad, None


def add_loss_gradient(out: torch.Tensor, loss: torch.Tensor, coef: float) -> torch.Tensor:
    """``out`` unchanged; its backward also back-propagates ``coef * loss``: a side loss (the
    MoE aux loss, multi-token prediction) trains its parameters without the training loss
    having to carry it."""
    return _ScaleGradientAdder.apply(out, loss, coef)


class _AllReduceGrad(torch.autograd.Function):
    """Identity in forward; in backward the gradient is summed over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _in_backward() -> bool:
    """True while autograd runs a backward pass: the forward being run is activation
    checkpointing's recompute, which must not count tokens a second time."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Routed (plus optional shared) SwiGLU experts replacing a block's feed-forward.

    ``forward`` maps (bs, seq, dim) to (bs, seq, dim). Per step state:

    - ``tokens_per_expert`` (E,) fp32 buffer: this rank's routed token counts since the last
      ``reset_load`` (for the load metrics and the loss-free bias update);
    - ``aux_loss`` the last forward's load-balancing loss (detached, before ``aux_loss_coef``).

    Set by the trainer / parallelize (defaults: one process, no scaling):

    - ``dispatcher``: where the experts run (``local_dispatch`` or expert parallel);
    - ``load_balance_group``: the process group whose ranks' tokens make up the batch (data x
      context parallel); the aux loss's per-expert token fractions are summed over it so that
      any data-parallel layout trains like one process;
    - ``aux_loss_scale``: factor on the aux loss's gradient, the same one the training loss of
      this forward gets (1 / gradient-accumulation steps).
    - ``tp_group``: under tensor parallelism, the group over which the routed experts' (hidden
      dim sharded) and shared experts' outputs are partial sums. Every TP rank sees the whole
      input and must compute the whole input gradient (its input is Replicate): so the two
      tensors that multiply into the partial sums, the experts' input rows and the routing
      weights, get their gradients summed over ``tp_group`` in backward (the shared experts'
      column-wise input does the same itself). The router then gets the full gradient on
      every TP rank, as a replicated module must.
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = FeedForward(dim, args.shared_dim) if args.shared_dim else None
        # Persistent only when it is training state (loss-free balancing), so checkpoints of
        # aux-loss models hold exactly the HF tensors.
        self.register_buffer(
            "expert_bias", torch.zeros(args.num_experts), persistent=args.load_balance_bias
        )
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.dispatcher: TokenDispatcher = local_dispatch
        self.load_balance_group: torch.distributed.ProcessGroup | None = None
        self.aux_loss_scale = 1.0
        self.aux_loss: torch.Tensor | None = None
        self.tp_group: torch.distributed.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim)."""
        bs, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if self.args.load_balance_bias else None
        scores, expert_ids, weights = self.router(tokens, bias)
        flat_ids = expert_ids.reshape(-1)  # (tokens * k,)
        counts = torch.bincount(flat_ids, minlength=self.args.num_experts)
        if not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        # Stable sort: each expert's rows keep token order, so every layout sums alike.
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // self.args.top_k
        rows, row_weights = tokens[token_of_row], weights.reshape(-1, 1)[order]
        if self.tp_group is not None:  # the outputs below are partial sums over tp
            rows = _AllReduceGrad.apply(rows, self.tp_group)
            row_weights = _AllReduceGrad.apply(row_weights, self.tp_group)
        routed = self.dispatcher(self.experts, rows, counts)  # (tokens * k, dim)
        out = self._combine(routed, row_weights, expert_ids, order, token_of_row).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.training and self.args.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self._aux_loss(scores, counts)
            self.aux_loss = aux.detach()
            out = _ScaleGradientAdder.apply(out, aux, self.args.aux_loss_coef * self.aux_loss_scale)
        return out.reshape(bs, seq, dim)

    def _combine(
        self,
        routed: torch.Tensor,
        row_weights: torch.Tensor,
        expert_ids: torch.Tensor,
        order: torch.Tensor,
        token_of_row: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's weighted expert outputs summed in float32, in ascending expert order
        whatever order top-k returned them in (transformers' loop order): the same bits on
        every device and layout, no atomics. ``routed`` rows are sorted by expert (``order``);
        returns (tokens, dim) float32."""
        n, k = expert_ids.shape
        rank = expert_ids.argsort(dim=-1).argsort(dim=-1)  # (tokens, k): place by expert id
        slot = token_of_row * k + rank.reshape(-1)[order]  # each row's place, token-major
        weighted = routed.float() * row_weights.float()
        by_token = weighted.new_zeros(weighted.shape).index_copy(0, slot, weighted).view(n, k, -1)
        out = by_token[:, 0]
        for j in range(1, k):  # sequential: a fixed summation order
            out = out + by_token[:, j]
        return out

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch-Transformer balance loss ``E * sum_e f_e * P_e`` (Qwen3-MoE's, per layer):
        ``f_e`` the fraction of routed slots that went to expert e over the whole batch (summed
        over ``load_balance_group``), ``P_e`` this rank's mean router probability of e."""
        counts = counts.to(torch.float32)
        if self.load_balance_group is not None:
            counts = counts.clone()
            torch.distributed.all_reduce(counts, group=self.load_balance_group)
        fraction = counts / counts.sum() * self.args.top_k  # sums to k, as HF's
        probs = scores if self.args.score_func == "softmax" else scores / scores.sum(-1, True)
        return self.args.num_experts * torch.sum(fraction * probs.mean(dim=0))

    def reset_load(self) -> None:
        """Zero ``tokens_per_expert`` (after a step's metrics and bias update used it)."""
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Loss-free balancing: move each expert's bias towards equal load by
        ``bias_update_rate * sign(mean - count)`` given the step's batch-wide ``counts``."""
        if not self.args.load_balance_bias:
            return
        delta = torch.sign(counts.mean() - counts) * self.args.bias_update_rate
        self.expert_bias.add_(delta - delta.mean())

    def init_weights(self, init_std: float) -> None:
        """Router, experts and shared experts; the expert bias and counts start at zero."""
        self.router.init_weights()
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """This model part's MoE modules keyed by their layer name (``layers.<i>``)."""
    return {
        name.removesuffix(".moe"): module
        for name, module in model.named_modules()
        if isinstance(module, MoE)
    }
