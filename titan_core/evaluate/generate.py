"""Greedy decoding for eval samples: a full-recompute loop, deterministic, no KV cache.

Each new token re-runs the model over the whole sequence; at eval sizes (a few prompts, tens of
tokens) that costs little and needs nothing from the model beyond ``forward(tokens)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from titan_core.config.job import Evaluate
from titan_core.data.tokenizer import Tokenizer
from titan_core.errors import ConfigError

# The defaults of the evaluate.prompts and evaluate.max_new_tokens config keys.
DEFAULT_PROMPTS: tuple[str, ...] = tuple(Evaluate().prompts)
DEFAULT_MAX_NEW_TOKENS = Evaluate().max_new_tokens

StopReason = Literal["eos", "max_new_tokens", "max_seq_len"]


@dataclass
class Sample:
    """One prompt and its greedy continuation."""

    prompt: str
    completion: str
    prompt_tokens: int
    new_tokens: list[int] = field(default_factory=list)
    stop_reason: StopReason = "max_new_tokens"

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form for the report."""
        return asdict(self)


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``, or nothing when ``dtype`` is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    max_seq_len: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> Sample:
    """Append the argmax token until eos, ``max_new_tokens`` or the RoPE table is reached.

    The prompt starts with bos, as training documents do. Under torchrun every rank must call
    this with the same prompt (FSDP's forward is collective); rank 0's choice is broadcast so
    that all ranks stop together.
    """
    ids = tokenizer.encode(prompt, bos=True, eos=False)
    if len(ids) > max_seq_len:
        raise ConfigError(
            f"--prompts: {prompt[:40]!r} is {len(ids)} tokens, more than the model's "
            f"max_seq_len {max_seq_len}"
        )
    tokens = torch.tensor([ids], dtype=torch.long, device=device)  # (1, seq)
    sample = Sample(prompt=prompt, completion="", prompt_tokens=len(ids))
    synced = dist.is_initialized() and dist.get_world_size() > 1
    while len(sample.new_tokens) < max_new_tokens:
        if tokens.shape[1] >= max_seq_len:
            sample.stop_reason = "max_seq_len"
            break
        with autocast_context(device, autocast_dtype):
            logits = model(tokens)[:, -1]  # (1, vocab)
        # Among the ids the tokenizer has (a vocabulary padded past it has rows no text maps
        # to); argmax takes the lowest id among ties, so the choice is deterministic.
        next_id = logits[:, : tokenizer.n_words].float().argmax(dim=-1)  # (1,)
        if synced:
            dist.broadcast(next_id, src=0)
        token = int(next_id.item())
        if token == tokenizer.eos_id:
            sample.stop_reason = "eos"
            break
        sample.new_tokens.append(token)
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
    sample.completion = tokenizer.decode(sample.new_tokens)
    return sample


def generate_samples(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    max_seq_len: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> list[Sample]:
    """Greedy samples for each prompt, in order."""
    return [
        greedy_generate(
            model,
            tokenizer,
            prompt,
            max_new_tokens=max_new_tokens,
            max_seq_len=max_seq_len,
            device=device,
            autocast_dtype=autocast_dtype,
        )
        for prompt in prompts
    ]
