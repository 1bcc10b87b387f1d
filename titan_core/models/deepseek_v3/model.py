"""DeepSeek-V3 (and its shapes: Moonlight, Kimi K2): the shared pre-norm decoder with
multi-head latent attention (``models.common.mla``), YaRN RoPE, ``first_k_dense_replace``
dense layers then group-limited sigmoid-routed experts with a shared expert and the loss-free
bias (``models.common.moe``), and multi-token prediction (``models.common.mtp``).

The MTP modules are blocks ``layers.<n_layers + d>`` (as the published checkpoints number them,
``model.layers.61`` for DeepSeek-V3), so that FSDP, activation checkpointing and the MoE load
statistics treat them as the layers they are. They run in training only; logits never depend
on them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_core.errors import ConfigError
from titan_core.models.common.decoder import Decoder, DecoderArgs, DecoderBlock
from titan_core.models.common.masking import AttentionMask, document_mask, document_positions
from titan_core.models.common.mla import MultiHeadLatentAttention
from titan_core.models.common.moe import MoEArgs, add_loss_gradient
from titan_core.models.common.mtp import IGNORE, MTPInput, mtp_losses
from titan_core.models.common.mtp import labels_ahead as mtp_labels_ahead
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import YarnScaling, freqs_at, yarn_softmax_mscale

__all__ = ["DeepseekV3Model", "DeepseekV3ModelArgs"]


def _v3_moe() -> MoEArgs:
    """DeepSeek-V3's routing: 256 experts in 8 groups, 4 groups and 8 experts per token,
    sigmoid scores renormalised then scaled by 2.5, one shared expert, loss-free balancing."""
    return MoEArgs(
        num_experts=256,
        top_k=8,
        hidden_dim=2048,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_shared_experts=1,
        aux_loss_coef=0.0,
        load_balance_bias=True,
        num_groups=8,
        top_groups=4,
    )


@dataclass
class DeepseekV3ModelArgs(DecoderArgs):
    """Shape hyper-parameters of a DeepSeek-V3 model (defaults: DeepSeek-V3 671B-A37B).

    ``hidden_dim`` is the dense layers' SwiGLU width (HF ``intermediate_size``), ``moe`` the
    routed layers' (HF ``n_routed_experts``, ``moe_intermediate_size``, ``n_group``, ...).
    """

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)  # type: ignore[assignment]
    max_seq_len: int = 4096
    moe: MoEArgs | None = field(default_factory=_v3_moe)
    hidden_dim: int = 18432
    """Hidden size of the dense layers' SwiGLU (HF ``intermediate_size``)."""
    q_lora_rank: int = 1536
    """Rank of the query latent; 0 projects queries straight from ``dim``."""
    kv_lora_rank: int = 512
    """Rank of the key/value latent (the KV cache per token, with the rotary key)."""
    qk_nope_head_dim: int = 128
    """Query/key channels per head without RoPE."""
    qk_rope_head_dim: int = 64
    """Query/key channels per head with RoPE (the key's shared by every head)."""
    v_head_dim: int = 128
    """Value channels per head."""
    first_k_dense_replace: int = 3
    """The first layers are dense, the rest MoE (HF ``first_k_dense_replace``)."""
    mtp_layers: int = 1
    """Multi-token prediction depth D (HF ``num_nextn_predict_layers``); 0 turns it off."""
    mtp_loss_weight: float = 0.3
    """Weight of the mean MTP loss in the training gradient (DeepSeek-V3: 0.3, later 0.1)."""
    rope_interleave: bool = True
    """Layout of the RoPE channels in HF checkpoints (HF ``rope_interleave``): interleaved
    pairs, as computed here, or halves (converted on the way in and out)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = (
            ("q_lora_rank", self.q_lora_rank >= 0, "an int >= 0"),
            ("kv_lora_rank", self.kv_lora_rank >= 1, "an int >= 1"),
            ("qk_nope_head_dim", self.qk_nope_head_dim >= 0, "an int >= 0"),
            (
                "qk_rope_head_dim",
                self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
                "an even int > 0",
            ),
            ("v_head_dim", self.v_head_dim >= 1, "an int >= 1"),
            ("hidden_dim", self.hidden_dim >= 1, "an int >= 1"),
            ("first_k_dense_replace", self.first_k_dense_replace >= 0, "an int >= 0"),
            ("mtp_layers", self.mtp_layers >= 0, "an int >= 0"),
            ("mtp_loss_weight", self.mtp_loss_weight >= 0, "a number >= 0"),
        )
        for key, ok, expected in checks:
            if not ok:
                raise ConfigError(f"model.{key}: expected {expected}, got {getattr(self, key)!r}")

    @property
    def head_dim(self) -> int:
        """Channels that RoPE rotates per head: the rotary table's width."""
        return self.qk_rope_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size of the dense layers' SwiGLU."""
        return self.hidden_dim

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(qk_nope + qk_rope)``, times YaRN's ``mscale_all_dim`` correction squared."""
        head = self.qk_nope_head_dim + self.qk_rope_head_dim
        return head**-0.5 * yarn_softmax_mscale(self.rope_scaling) ** 2

    def moe_layer(self, layer_id: int) -> bool:
        """Dense below ``first_k_dense_replace``, MoE from there on (MTP blocks included)."""
        return self.moe is not None and layer_id >= self.first_k_dense_replace

    def _attention_params(self) -> int:
        dim, heads = self.dim, self.n_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        else:
            q = dim * heads * qk
        kv = dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * dim

    def param_counts(self) -> tuple[int, int]:
        """(total, activated per token) parameters from the shapes: the decoder's layers, then
        the MTP blocks (each a layer plus its two input norms, projection and head norm)."""
        dim, total, activated = self.dim, 0, 0
        for layer_id in range(self.n_layers + self.mtp_layers):
            ffn_total = ffn_active = 3 * dim * self.hidden_dim
            if self.moe is not None and self.moe_layer(layer_id):
                ffn_total, ffn_active = self.moe.num_params(dim)
            fixed = self._attention_params() + 2 * dim  # + attention_norm, ffn_norm
            if layer_id >= self.n_layers:
                fixed += 3 * dim + 2 * dim * dim  # enorm, hnorm, head_norm; eh_proj
            total += fixed + ffn_total
            activated += fixed + ffn_active
        embedding = self.vocab_size * dim
        output = 0 if self.tie_word_embeddings else self.vocab_size * dim
        rest = embedding + dim + output
        return total + rest, activated + rest

    def mtp_param_counts(self) -> tuple[int, int]:
        """(total, activated) parameters of the MTP blocks alone. ``param_counts`` includes
        them; the published counts (DeepSeek-V3's 671B / 37B) leave them out."""
        total, activated = self.param_counts()
        main_total, main_activated = dataclasses.replace(self, mtp_layers=0).param_counts()
        return total - main_total, activated - main_activated

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters of ``model``, training FLOPs per token): 6 x activated matmul weights
        (the low-rank MLA projections, the top-k routed and shared experts, the MTP blocks) plus
        6 x the output head once more per MTP depth (it is shared: one copy, used again), plus
        attention's scores (qk = nope + rope channels) and values (v channels) over
        ``seq_len``, counted as if not causal as for the other families."""
        nparams = sum(p.numel() for p in model.parameters())
        nparams_embedding = 0  # a tied table is also the output matmul: counted then
        if not self.tie_word_embeddings:
            nparams_embedding = sum(
                p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters()
            )  # fmt: skip
        activated = nparams - nparams_embedding - self.inactive_expert_params()
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        layers = self.n_layers + self.mtp_layers
        attention_flops = 6 * layers * self.n_heads * (qk + self.v_head_dim) * seq_len
        mtp_head = 0
        if getattr(model, "output", None) is not None:
            mtp_head = self.mtp_layers * self.vocab_size * self.dim
        return nparams, 6 * (activated + mtp_head) + attention_flops


class DeepseekV3Block(DecoderBlock):
    """Pre-norm layer: MLA, then a dense SwiGLU or the MoE (``first_k_dense_replace``)."""

    def __init__(self, layer_id: int, args: DeepseekV3ModelArgs) -> None:
        mla = MultiHeadLatentAttention(
            args.dim,
            args.n_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            softmax_scale=args.softmax_scale,
        )
        super().__init__(layer_id, args, attention=mla)  # type: ignore[arg-type]


class DeepseekV3MTPBlock(DeepseekV3Block):
    """One multi-token prediction depth: ``mtp_input`` combines the previous depth's hidden
    states with the next tokens' embeddings, then the layer runs; ``head_norm`` precedes the
    shared output head (HF ``shared_head.norm``)."""

    def __init__(self, layer_id: int, args: DeepseekV3ModelArgs) -> None:
        super().__init__(layer_id, args)
        self.mtp_input = MTPInput(args.dim, args.norm_eps)
        self.head_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(  # type: ignore[override]
        self,
        h: torch.Tensor,
        emb: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: AttentionMask = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bs, seq, dim) hidden states and embeddings -> the new hidden states and their
        ``head_norm`` (the output head's input), both (bs, seq, dim). The head norm runs inside
        the block's forward: under FSDP its weight is gathered only there."""
        h = super().forward(self.mtp_input(h, emb), freqs_cis, mask=mask)
        return h, self.head_norm(h)

    def init_weights(self) -> None:
        """The layer's init, plus the input norms and projection and the head norm."""
        super().init_weights()
        self.mtp_input.init_weights()
        self.head_norm.init_weights()


class DeepseekV3Model(Decoder):
    """DeepSeek-V3 decoder: tokens (bs, seq) -> logits (bs, seq, vocab).

    In training (grad enabled, ``mtp_layers`` > 0) ``forward`` also runs the MTP blocks: their
    mean loss times ``mtp_loss_weight * mtp_loss_scale`` reaches the gradient through the
    logits' backward, and ``mtp_loss`` keeps its value (detached) for the metrics. The trainer
    sets ``mtp_loss_scale`` to its training loss's factor (1 / gradient-accumulation steps) and
    logs ``mtp_loss`` as ``mtp/loss`` (``components.mtp_stats``); it passes ``labels_ahead``
    (built from the whole window before context parallel splits it), so the last positions
    predict too.
    """

    def __init__(self, args: DeepseekV3ModelArgs) -> None:
        nn.Module.__init__(self)  # Decoder's methods over DeepSeek-V3's blocks
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        blocks: dict[str, nn.Module] = {
            str(i): DeepseekV3Block(i, args) for i in range(args.n_layers)
        }
        for i in range(args.n_layers, args.n_layers + args.mtp_layers):
            blocks[str(i)] = DeepseekV3MTPBlock(i, args)
        self.layers = nn.ModuleDict(blocks)
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.mtp_loss_scale = 1.0
        self.mtp_context_parallel = 1  # the trainer's CP degree (``mtp_losses``)
        self.mtp_loss: torch.Tensor | None = None

    def _blocks(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """(decoder layers, MTP blocks) this model part holds, in order."""
        n = self.model_args.n_layers
        items = sorted(self.layers.items(), key=lambda kv: int(kv[0]))
        return [b for k, b in items if int(k) < n], [b for k, b in items if int(k) >= n]

    @property
    def mtp_depth(self) -> int:
        """How many MTP modules this model part trains (0: none, or not the last stage): the
        trainer passes ``labels_ahead(labels, mtp_depth)`` to ``forward``."""
        return len(self._blocks()[1]) if self.output is not None else 0

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels_ahead: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (bs, seq) -> logits (bs, seq, vocab); ``doc_ids`` as ``Decoder``'s.
        ``labels_ahead`` (optional, ``mtp.labels_ahead``'s (bs, seq, mtp_depth + 1)) gives the
        MTP modules their tokens and targets ahead; without it they are read from ``tokens``
        (the last position has no target)."""
        # A pipeline stage holds only its part (``Decoder``'s convention): hidden states in/out.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        if seq > self.freqs_cis.shape[0]:
            raise ValueError(
                f"sequence length {seq} exceeds the RoPE table ({self.freqs_cis.shape[0]} rows); "
                "raise model.max_seq_len"
            )
        freqs_cis, mask = self.freqs_cis, None
        if doc_ids is not None:
            mask = document_mask(doc_ids)
            if self.model_args.document_positions:
                freqs_cis = freqs_at(self.freqs_cis, document_positions(doc_ids))
        layers, mtp_blocks = self._blocks()
        for layer in layers:
            h = layer(h, freqs_cis, mask=mask)  # (bs, seq, dim)
        if self.output is None:  # not the last stage (MTP is refused under PP)
            return h  # (bs, seq, dim)
        logits = self.output(self.norm(h))  # (bs, seq, vocab)
        self.mtp_loss = None  # a forward without MTP leaves no stale value to log
        if mtp_blocks and self.training and torch.is_grad_enabled():
            if labels_ahead is None:
                after = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)], 1)
                labels_ahead = mtp_labels_ahead(after, len(mtp_blocks))
            losses = mtp_losses(
                h,
                labels_ahead,
                mtp_blocks,
                self.tok_embeddings,
                self.output,
                freqs_cis,
                mask=mask,
                context_parallel=self.mtp_context_parallel,
            )
            if losses:
                loss = torch.stack(losses).mean()
                self.mtp_loss = loss.detach()
                weight = self.model_args.mtp_loss_weight * self.mtp_loss_scale
                logits = add_loss_gradient(logits, loss, weight)
        return logits

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Decoder's init (every block's own, MTP blocks included); no MTP loss yet."""
        super().init_weights(buffer_device)
        self.mtp_loss = None
