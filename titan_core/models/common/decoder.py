"""A pre-norm decoder-only transformer shared by the dense families (Llama 3, Qwen3, ...).

A family supplies its args (a ``DecoderArgs`` subclass giving ``head_dim`` and
``ffn_hidden_dim``, and its flavors); the modules here read only the fields below. Module names
(``tok_embeddings``, ``layers.<i>.attention.wq``, ``norm``, ``output``...) are what the shared
parallel plan (``models.common.parallelize``), the pipeline split (``models.common.pipeline``)
and the families' state-dict adapters key on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_core.errors import ConfigError
from titan_core.models.common.attention import Attention
from titan_core.models.common.feed_forward import FeedForward
from titan_core.models.common.masking import AttentionMask, document_mask, document_positions
from titan_core.models.common.moe import MoE, MoEArgs
from titan_core.models.common.rmsnorm import RMSNorm
from titan_core.models.common.rope import RopeScaling, freqs_at, precompute_freqs_cis


@dataclass
class DecoderArgs:
    """Shape and initialization hyper-parameters every decoder family shares.

    Subclasses add ``head_dim`` and ``ffn_hidden_dim`` (a field or a property each).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE."""
    depth_init: bool = True
    document_positions: bool = False
    """When ``forward`` gets ``doc_ids``: RoPE positions restart at 0 at each document start."""
    moe: MoEArgs | None = None
    """Mixture-of-experts feed-forward for the layers ``moe_layer`` picks; None: dense only."""

    def __post_init__(self) -> None:
        if self.n_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"model.n_kv_heads: expected a divisor of n_heads, got {self.n_kv_heads!r}"
            )

    def moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has a mixture-of-experts feed-forward (every layer when
        ``moe`` is set; families override this for interleaved dense layers)."""
        return self.moe is not None

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads, ``n_heads`` when ``n_kv_heads`` is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def num_params(self) -> int:
        """Parameter count from the shapes alone (tied embeddings counted once)."""
        return self.param_counts()[0]

    def num_activated_params(self) -> int:
        """Parameters one token goes through (only its top-k routed experts count)."""
        return self.param_counts()[1]

    def param_counts(self) -> tuple[int, int]:
        """(total, activated per token) parameter counts from the shapes alone."""
        dim, hd = self.dim, self.head_dim  # type: ignore[attr-defined]
        attention = dim * self.n_heads * hd * 2 + dim * self.num_kv_heads * hd * 2
        qk_norm = 2 * hd if self.qk_norm else 0
        dense_ffn = 3 * dim * self.ffn_hidden_dim  # type: ignore[attr-defined]
        total = activated = 0
        for layer_id in range(self.n_layers):
            ffn_total = ffn_active = dense_ffn
            if self.moe is not None and self.moe_layer(layer_id):
                ffn_total, ffn_active = self.moe.num_params(dim)
            fixed = attention + qk_norm + 2 * dim  # + attention_norm, ffn_norm
            total += fixed + ffn_total
            activated += fixed + ffn_active
        embedding = self.vocab_size * dim
        output = 0 if self.tie_word_embeddings else self.vocab_size * dim
        rest = embedding + dim + output
        return total + rest, activated + rest

    def inactive_expert_params(self) -> int:
        """Routed-expert parameters a token skips (total minus activated)."""
        total, activated = self.param_counts()
        return total - activated

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters of ``model``, training FLOPs per token) by torchtitan's formula."""
        nparams = sum(p.numel() for p in model.parameters())  # shared weights counted once
        # Embedding lookups do no matmul work, but a tied table is also the output projection,
        # which does: only an untied table is left out of the FLOPs.
        nparams_embedding = 0
        if not self.tie_word_embeddings:
            nparams_embedding = sum(
                p.numel()
                for m in model.modules()
                if isinstance(m, nn.Embedding)
                for p in m.parameters()
            )
        head_dim = self.head_dim  # type: ignore[attr-defined]
        attention_flops = 12 * self.n_layers * self.n_heads * head_dim * seq_len
        # MoE: a token's matmuls touch only its top-k experts (activated parameters).
        activated = nparams - nparams_embedding - self.inactive_expert_params()
        return nparams, 6 * activated + attention_flops


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(
        self, layer_id: int, args: DecoderArgs, attention: nn.Module | None = None
    ) -> None:
        """``attention``: a family's own attention module (DeepSeek-V3's MLA) in place of
        grouped-query attention; it takes ``(x, freqs_cis, mask=...)`` like ``Attention``."""
        super().__init__()
        self.attention = attention or Attention(
            args.dim,
            args.n_heads,
            args.num_kv_heads,
            head_dim=args.head_dim,  # type: ignore[attr-defined]
            qk_norm=args.qk_norm,
            norm_eps=args.norm_eps,
        )
        # A layer has either a dense ``feed_forward`` or a mixture-of-experts ``moe``.
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if args.moe is not None and args.moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)  # type: ignore[attr-defined]
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Residual-writing projections shrink with depth so activations do not grow with layers.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor:
        """Map (bs, seq, dim) to (bs, seq, dim); ``mask`` None is causal attention."""
        # mask by keyword: tensor parallelism prepares the positional inputs only.
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask=mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        """Initialize norms and projections in place."""
        for norm in (self.attention_norm, self.ffn_norm):
            norm.init_weights()
        self.attention.init_weights(self.weight_init_std)
        ffn = self.moe if self.moe is not None else self.feed_forward
        ffn.init_weights(self.weight_init_std)


class Decoder(nn.Module):
    """Decoder-only transformer: tokens (bs, seq) -> logits (bs, seq, vocab).

    ``tok_embeddings``, ``norm`` and ``output`` may be set to None and layers deleted from
    ``layers`` so that a pipeline stage keeps only its part; ``forward`` then passes hidden
    states through.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the layer's global index so stage splitting and checkpoints keep stable names.
        self.layers = nn.ModuleDict({str(i): DecoderBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        # Non-persistent: derived from the args, so checkpoints need not carry it.
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(
            args.head_dim,  # type: ignore[attr-defined]
            args.max_seq_len,
            args.rope_theta,
            args.rope_scaling,
        )  # (max_seq_len, head_dim // 2)

    def _tie_weights(self) -> None:
        tied = self.model_args.tie_word_embeddings
        if tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter and recompute ``freqs_cis`` (on ``buffer_device`` if given)."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        # to_empty() gives each module a fresh tensor, which silently unties shared weights.
        self._tie_weights()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        # A tied table keeps the embedding init: redrawing it here would undo the line above.
        if self.output is not None and not self.model_args.tie_word_embeddings:
            std = self.model_args.dim**-0.5
            cutoff = 3.0
            nn.init.trunc_normal_(
                self.output.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std
            )

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Map token ids (bs, seq) int64 — or hidden states in a later pipeline stage — onward.

        ``doc_ids`` (bs, seq) numbers the documents packed in each sample: attention then stays
        within each document, and with ``document_positions`` RoPE restarts at each one.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        if seq > self.freqs_cis.shape[0]:
            raise ValueError(
                f"sequence length {seq} exceeds the RoPE table ({self.freqs_cis.shape[0]} rows); "
                "raise model.max_seq_len"
            )
        # The whole table: attention uses its first rows. Under sequence parallelism ``seq`` here
        # is this rank's slice, while attention sees (and rotates) the full sequence.
        freqs_cis, mask = self.freqs_cis, None
        if doc_ids is not None:  # built once, shared by every layer
            mask = document_mask(doc_ids)
            if self.model_args.document_positions:  # one row per token: (bs, seq, hd // 2)
                freqs_cis = freqs_at(self.freqs_cis, document_positions(doc_ids))
        for layer in self.layers.values():
            h = layer(h, freqs_cis, mask=mask)  # (bs, seq, dim)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h  # (bs, seq, vocab)
