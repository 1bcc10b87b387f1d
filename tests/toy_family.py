"""A third model family for tests/test_model_protocol.py, defined outside titan_core: a residual
MLP language model with its own module names, parallelize (FSDP only), refusals, HF adapter
(``ToyForCausalLM``) and recipe (this module is its config registry: ``--module toy --config
toy_tiny``). Importing it registers nothing; the test registers ``TOY_SPEC`` (or an entry point
names it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.config.job import JobConfig
from titan_core.distributed.fsdp import apply_fsdp
from titan_core.errors import ConfigError
from titan_core.models import HFAdapter, ModelSpec


@dataclasses.dataclass
class ToyArgs:
    """A residual MLP language model: no attention, no RoPE, nothing of the decoder's."""

    dim: int = 32
    hidden: int = 64
    n_layers: int = 2
    vocab_size: int = 256
    max_seq_len: int = 64  # the engine sets these two on every family's args
    document_positions: bool = False


class ToyBlock(nn.Module):
    """``h + down(gelu(up(h + mix(mean of h over the tokens so far))))``."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.mix = nn.Linear(args.dim, args.dim, bias=False)
        self.up = nn.Linear(args.dim, args.hidden)
        self.down = nn.Linear(args.hidden, args.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim), causal."""
        count = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)[:, None]
        return h + self.down(F.gelu(self.up(h + self.mix(h.cumsum(1) / count))))


class ToyLM(nn.Module):
    """tokens (bs, seq) -> logits (bs, seq, vocab)."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.model_args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(ToyBlock(args) for _ in range(args.n_layers))
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Every weight from N(0, 0.02): the engine calls this after materializing."""
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the next token at every position (``doc_ids`` ignored)."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


_TOY_TOP = {"embed.weight": "toy.embed_tokens.weight", "head.weight": "lm_head.weight"}


def _toy_to_hf(state_dict: dict[str, torch.Tensor], args: ToyArgs) -> dict[str, torch.Tensor]:
    return {
        _TOY_TOP.get(k, k.replace("blocks.", "toy.layers.", 1)): v for k, v in state_dict.items()
    }


def _toy_from_hf(state_dict: dict[str, torch.Tensor], args: ToyArgs) -> dict[str, torch.Tensor]:
    back = {hf: k for k, hf in _TOY_TOP.items()}
    return {back.get(k, k.replace("toy.layers.", "blocks.", 1)): v for k, v in state_dict.items()}


def _toy_to_hf_config(args: ToyArgs) -> dict[str, Any]:
    return {
        "architectures": ["ToyForCausalLM"],
        "model_type": "toy",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden,
        "num_hidden_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
    }


def _toy_from_hf_config(config: dict[str, Any], source: str) -> ToyArgs:
    return ToyArgs(
        dim=config["hidden_size"],
        hidden=config["intermediate_size"],
        n_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        max_seq_len=config["max_position_embeddings"],
    )


def _toy_parallelize(model: nn.Module, parallel_dims: Any, cfg: JobConfig) -> nn.Module:
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            model.blocks,
            parallel_dims.mesh[parallel_dims.fsdp_mesh_dims],
            param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=True,
        )
    return model


def _toy_check(parallel_dims: Any, cfg: JobConfig, device_type: str, args: ToyArgs) -> None:
    for name, degree in (("pipeline", parallel_dims.pp), ("tensor", parallel_dims.tp)):
        if degree > 1:
            raise ConfigError(
                f"parallelism.{name}_parallel_degree: the toy family runs data parallel only, "
                f"got {degree}"
            )


def _toy_no_pipeline(*args: Any, **kwargs: Any) -> Any:
    raise ConfigError("parallelism.pipeline_parallel_degree: the toy family has no pipeline split")


def _toy_size(args: ToyArgs, model: nn.Module, seq_len: int) -> tuple[int, int]:
    nparams = sum(p.numel() for p in model.parameters())
    return nparams, 6 * nparams


def toy_tiny() -> JobConfig:
    """The toy family's one recipe (``--module toy --config toy_tiny``)."""
    cfg = JobConfig()
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, name="toy", flavor="tiny"),
        training=dataclasses.replace(cfg.training, local_batch_size=2, seq_len=32, steps=4),
        lr_scheduler=dataclasses.replace(cfg.lr_scheduler, warmup_steps=1, decay_ratio=0.0),
        checkpoint=dataclasses.replace(
            cfg.checkpoint, enable=True, interval=2, last_save_model_only=False
        ),
        validation=dataclasses.replace(cfg.validation, enable=False),
        metrics=dataclasses.replace(cfg.metrics, log_freq=1),
    )


TOY_SPEC = ModelSpec(
    name="toy",
    model_cls=ToyLM,
    args_cls=ToyArgs,
    flavors={"tiny": ToyArgs()},
    parallelize=_toy_parallelize,
    pipeline=_toy_no_pipeline,
    plan_pipeline=_toy_no_pipeline,
    tp_plan=lambda model, loss_parallel, float8: {},
    check=_toy_check,
    nparams_and_flops=_toy_size,
    hf=HFAdapter(
        architectures=("ToyForCausalLM",),
        model_type="toy",
        to_hf=_toy_to_hf,
        from_hf=_toy_from_hf,
        to_hf_config=_toy_to_hf_config,
        from_hf_config=_toy_from_hf_config,
    ),
    config_registry=__name__,  # this module: toy_tiny is its one recipe
    description="a residual-MLP toy LM registered from a test file",
)
