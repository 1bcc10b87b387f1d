"""Greedy decoding for eval samples: a full-recompute loop, deterministic, no KV cache.

Each new token re-runs the model over the whole sequence; at eval sizes (a few prompts, tens of
tokens) that costs little and needs nothing from the model beyond ``forward(tokens)``.

A sample is text: the argmax is taken among the ids that can be shown as text at that point
(``TextIds``). Special tokens (bos, the reserved ones) never are, eos only stops; a byte-level
token is allowed only where its bytes keep the completion valid UTF-8, so a character split over
several tokens is completed, never left as U+FFFD, and the completion is decoded whole at the end.
"""

from __future__ import annotations

import codecs
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


_UTF8_DECODER = codecs.getincrementaldecoder("utf-8")


def _continues_utf8(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8, or a start of it cut inside a character that some
    bytes can still finish (the incremental decoder keeps ``ED A0``, which only a surrogate, never
    valid UTF-8, would continue)."""
    decoder = _UTF8_DECODER()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    pending = decoder.getstate()[0]
    if not pending:
        return True
    size = 2 if pending[0] < 0xE0 else 3 if pending[0] < 0xF0 else 4  # from the lead byte
    rest = size - len(pending) - 1  # continuation bytes after the next one
    return any(_is_text(pending + bytes([b]) + b"\x80" * rest) for b in range(0x80, 0xC0))


def _is_text(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8, every character complete."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class TextIds:
    """Which token ids a greedy sample may pick: eos (it stops the sample) and the ordinary
    tokens whose bytes, after the completion's unfinished character (``pending``), are still
    valid UTF-8; never a special token. Masks are kept per ``pending`` (at most 3 bytes)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        specials = set(tokenizer.special_tokens.values())
        decode = tokenizer.model.decode_single_token_bytes
        self.token_bytes: list[bytes | None] = [
            None if i in specials else decode(i) for i in range(tokenizer.n_words)
        ]
        self.eos_id = tokenizer.eos_id
        self._masks: dict[bytes, torch.Tensor] = {}

    def allowed(self, pending: bytes) -> torch.Tensor:
        """(n_words,) bool: the ids allowed after the completion's unfinished bytes ``pending``."""
        mask = self._masks.get(pending)
        if mask is None:
            mask = torch.tensor(
                [b is not None and _continues_utf8(pending + b) for b in self.token_bytes]
            )
            mask[self.eos_id] = True
            self._masks[pending] = mask
        return mask

    def complete(self, ids: list[int]) -> list[int]:
        """``ids`` without the tokens of an unfinished character at the end (a sample cut short
        by ``max_new_tokens`` or eos inside one): the rest decodes to text without U+FFFD."""
        ids = list(ids)
        while ids and not _is_text(b"".join(self.token_bytes[i] or b"" for i in ids)):
            ids.pop()
        return ids


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
    text_ids: TextIds | None = None,
) -> Sample:
    """Append the argmax token among those that show as text (``text_ids``, built from
    ``tokenizer`` when not given) until eos, ``max_new_tokens`` or the RoPE table is reached.

    The prompt starts with bos, as training documents do. Under torchrun every rank must call
    this with the same prompt (FSDP's forward is collective); rank 0's choice is broadcast so
    that all ranks stop together.
    """
    text_ids = text_ids or TextIds(tokenizer)
    utf8 = _UTF8_DECODER()  # the completion so far; its state is an unfinished character
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
        # to) that show as text here; argmax takes the lowest id among ties, so the choice is
        # deterministic.
        scores = logits[:, : tokenizer.n_words].float()  # (1, n_words)
        allowed = text_ids.allowed(utf8.getstate()[0])[: scores.shape[-1]].to(scores.device)
        next_id = scores.masked_fill(~allowed, float("-inf")).argmax(dim=-1)  # (1,)
        if synced:
            dist.broadcast(next_id, src=0)
        token = int(next_id.item())
        if token == tokenizer.eos_id:
            sample.stop_reason = "eos"
            break
        sample.new_tokens.append(token)
        utf8.decode(text_ids.token_bytes[token] or b"", final=False)
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
    sample.new_tokens = text_ids.complete(sample.new_tokens)
    sample.completion = tokenizer.decode(sample.new_tokens)  # the whole sequence at once
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
    text_ids = TextIds(tokenizer)  # once: it decodes every token's bytes
    return [
        greedy_generate(
            model,
            tokenizer,
            prompt,
            max_new_tokens=max_new_tokens,
            max_seq_len=max_seq_len,
            device=device,
            autocast_dtype=autocast_dtype,
            text_ids=text_ids,
        )
        for prompt in prompts
    ]
