"""Multiple-choice tasks scored as ranked choices (OLMES "RC"): each choice is a continuation of
the context, and the model's summed log-likelihoods of the choices rank them.

The steps, each a function, so that an in-loop evaluator can shard the work:

1. ``build_requests``: the prompt (few-shot examples, then the context), tokenized once per
   example, and one request per choice: context tokens + continuation tokens, the context cut
   from the left to fit ``max_seq_len`` (counted, never dropped).
2. ``plan_batches``: every request in batches of similar lengths (longest first), a fixed plan.
3. ``shard_batches``: a data-parallel rank's share of the plan, the same number of forwards on
   every rank.
4. ``score_requests``: the log-likelihood of each request's continuation, exact in fp32
   (log_softmax of fp32 logits, summed in float64), in a tensor over all requests that is zero
   outside this rank's share: an all-reduce (sum) over the ranks completes it.
5. ``choice_metrics``: accuracy (raw, per token, per character) and the gold continuation's
   bits per byte from the complete tensor.

``score_choice_task`` runs 2-5 on a process group. The model is any callable from token ids
``(bs, seq)`` to logits ``(bs, seq, vocab)`` that is causal: right padding never changes a
request's score (an MoE router that drops tokens by capacity would break that).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from titan_core.data.choice_tasks import ChoiceExample
from titan_core.errors import ConfigError, DataError

CONTINUATION_DELIMITER = " "  # a choice is scored as " " + choice right after the context
SHOT_SEPARATOR = "\n\n"  # between few-shot examples, and between the last one and the context
FEW_SHOT_SEED = 1234

Model = Callable[[torch.Tensor], torch.Tensor]  # (bs, seq) token ids -> (bs, seq, vocab)


class Encoder(Protocol):
    """What scoring needs of a tokenizer (``titan_core.data.Tokenizer`` is one)."""

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...


@dataclass(frozen=True)
class ChoiceRequest:
    """One (context, choice) pair as tokens: ``tokens[-num_scored:]`` is the continuation."""

    example: int  # index of the example in its task
    choice: int  # index of the choice in the example
    tokens: tuple[int, ...]  # context (left-truncated) + continuation; the model sees [:-1]
    num_scored: int  # continuation tokens, whose log-likelihoods are summed
    num_chars: int  # characters of the continuation text (delimiter included)
    num_bytes: int  # UTF-8 bytes of the continuation text
    num_dropped: int  # context tokens cut from the left to fit max_seq_len


@dataclass(frozen=True)
class ChoiceRequests:
    """Every request of one task, example by example, choice by choice."""

    name: str
    examples: tuple[ChoiceExample, ...]
    requests: tuple[ChoiceRequest, ...]
    offsets: tuple[int, ...]  # example i's requests: requests[offsets[i] : offsets[i + 1]]

    @property
    def num_truncated(self) -> int:
        """Examples whose context was cut (for at least one choice) to fit max_seq_len."""
        return len({r.example for r in self.requests if r.num_dropped})


@dataclass(frozen=True)
class ChoiceMetrics:
    """A task's scores; accuracies: higher is better, bits per byte: lower is better."""

    name: str
    num_examples: int
    num_truncated: int  # examples whose context was cut from the left
    acc: float  # argmax of the summed log-likelihood is the gold choice
    acc_per_token: float  # argmax of log-likelihood / continuation tokens
    acc_per_char: float  # argmax of log-likelihood / continuation characters
    bits_per_byte: float  # gold continuations: -sum(log-likelihood) / ln 2 / sum(bytes)
    loglikelihoods: tuple[tuple[float, ...], ...]  # per example, per choice (nats)

    def summary(self) -> dict[str, float | int]:
        """The scalar metrics by name (no per-example values), e.g. for a metrics logger."""
        keys = ("num_examples", "num_truncated", "acc", "acc_per_token", "acc_per_char")
        return {k: getattr(self, k) for k in (*keys, "bits_per_byte")}


def draw_shots(
    shots: Sequence[ChoiceExample], num_shots: int, *, seed: int = FEW_SHOT_SEED
) -> list[ChoiceExample]:
    """``num_shots`` of ``shots``, drawn without replacement by ``random.Random(seed)``."""
    if num_shots < 0 or num_shots > len(shots):
        raise ConfigError(f"num_shots: expected 0..{len(shots)} (the shots given), got {num_shots}")
    return [shots[i] for i in random.Random(seed).sample(range(len(shots)), num_shots)]


def few_shot_prefix(shots: Sequence[ChoiceExample], separator: str = SHOT_SEPARATOR) -> str:
    """The text every prompt of a task starts with (OLMES: one fixed set of shots per task):
    each shot as context + delimiter + its gold choice, followed by ``separator``."""
    return "".join(
        s.context + CONTINUATION_DELIMITER + s.choices[s.gold] + separator for s in shots
    )


def build_requests(
    name: str,
    examples: Sequence[ChoiceExample],
    tokenizer: Encoder,
    *,
    max_seq_len: int,
    shots: Sequence[ChoiceExample] = (),
    num_shots: int = 0,
    seed: int = FEW_SHOT_SEED,
    separator: str = SHOT_SEPARATOR,
) -> ChoiceRequests:
    """The requests of task ``name``: per example, ``[bos] + encode(prefix + context)`` then,
    per choice, ``encode(" " + choice)``; the context loses tokens from the left (bos first)
    until context + continuation - 1 <= ``max_seq_len``, the length the model sees.

    Few-shot examples come from ``shots``, another split than ``examples`` (a shot that is
    also an example is a ConfigError: it would give the answer away)."""
    drawn = draw_shots(shots, num_shots, seed=seed)
    asked = {e.context for e in examples}
    if leaked := [s for s in drawn if s.context in asked]:
        raise ConfigError(
            f"{name}: few-shot example {leaked[0].context[:40]!r} is also an example to "
            "score; draw shots from another split"
        )
    prefix = few_shot_prefix(drawn, separator)
    requests: list[ChoiceRequest] = []
    offsets = [0]
    for i, example in enumerate(examples):
        context = tokenizer.encode(prefix + example.context, bos=True, eos=False)
        for c, choice in enumerate(example.choices):
            text = CONTINUATION_DELIMITER + choice
            continuation = tokenizer.encode(text, bos=False, eos=False)
            fits = max_seq_len + 1 - len(continuation)  # context tokens that fit
            if fits < 1:
                raise DataError(
                    f"{name}: example {i} choice {c} is {len(continuation)} tokens; at most "
                    f"max_seq_len {max_seq_len} fit after one context token"
                )
            dropped = max(0, len(context) - fits)
            requests.append(
                ChoiceRequest(
                    example=i,
                    choice=c,
                    tokens=(*context[dropped:], *continuation),
                    num_scored=len(continuation),
                    num_chars=len(text),
                    num_bytes=len(text.encode("utf-8")),
                    num_dropped=dropped,
                )
            )
        offsets.append(len(requests))
    return ChoiceRequests(name, tuple(examples), tuple(requests), tuple(offsets))


def plan_batches(
    requests: Sequence[ChoiceRequest], batch_size: int, *, max_tokens: int = 0
) -> list[list[int]]:
    """Request indices in batches of ``batch_size``, longest first (ties by index), so that a
    batch pads little and an out-of-memory shows in the first batch. A fixed plan: the same
    requests always give the same batches.

    With ``max_tokens`` (e.g. training's ``batch_size x seq_len``), short requests are packed:
    a batch takes the largest multiple of ``batch_size`` rows whose width (its first request's,
    the longest) fits ``max_tokens`` tokens, so a task of short requests runs in a few full
    forwards instead of many small ones; never fewer than ``batch_size`` rows."""
    if batch_size < 1:
        raise ConfigError(f"batch_size: expected an int >= 1, got {batch_size}")
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    if max_tokens <= 0:
        return [order[lo : lo + batch_size] for lo in range(0, len(order), batch_size)]
    batches, lo = [], 0
    while lo < len(order):
        width = max(1, len(requests[order[lo]].tokens) - 1)  # what the model sees
        rows = batch_size * max(1, max_tokens // (width * batch_size))
        batches.append(order[lo : lo + rows])
        lo += rows
    return batches


def shard_batches(
    batches: Sequence[list[int]], rank: int, world_size: int
) -> list[tuple[list[int], bool]]:
    """Rank ``rank``'s share of ``batches``, round-robin, as ``(batch, counts)``: in the last
    round a rank left without a batch reruns the round's first with counts=False, so every
    rank runs the same number of forwards (FSDP's forward is collective)."""
    share = []
    for lo in range(0, len(batches), world_size):
        group = batches[lo : lo + world_size]
        share.append((group[rank], True) if rank < len(group) else (group[0], False))
    return share


def _batch_inputs(
    requests: Sequence[ChoiceRequest], batch: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs (bs, width), and per scored token: its row, position and target."""
    rows = [requests[i] for i in batch]
    width = max(len(r.tokens) - 1 for r in rows)
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (bs, width)
    row_ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for b, r in enumerate(rows):
        n = len(r.tokens) - 1
        inputs[b, :n] = torch.tensor(r.tokens[:-1])
        row_ids += [b] * r.num_scored
        positions += range(n - r.num_scored, n)  # the position before each continuation token
        targets += r.tokens[-r.num_scored :]
    as_long = {"dtype": torch.long}
    return (
        inputs,
        torch.tensor(row_ids, **as_long),
        torch.tensor(positions, **as_long),
        torch.tensor(targets, **as_long),
    )


@torch.no_grad()
def score_requests(
    model: Model,
    requests: Sequence[ChoiceRequest],
    shard: Sequence[tuple[list[int], bool]],
    *,
    device: torch.device,
    pad_id: int = 0,
) -> torch.Tensor:
    """Log-likelihood (nats) of each request's continuation, (num_requests,) float64 on the
    CPU, 0.0 for requests outside ``shard`` (``shard_batches``' output).

    Only the scored positions' logits are taken, in fp32 whatever the forward's dtype; their
    log_softmax gives each token's log-probability, and a request's are summed in float64 in
    token order. Padding is on the right, so a request scores the same in any batch up to
    the forward's own floating-point differences."""
    out = torch.zeros(len(requests), dtype=torch.float64)
    for batch, counts in shard:
        inputs, row_ids, positions, targets = _batch_inputs(requests, batch, pad_id)
        logits = model(inputs.to(device))  # (bs, width, vocab); None: PP's other stages
        if not counts or logits is None:
            continue
        picked = logits[row_ids.to(device), positions.to(device)].float()  # (scored, vocab)
        logp = torch.log_softmax(picked, dim=-1).gather(1, targets.to(device)[:, None])
        per_token = logp.squeeze(1).double().cpu()  # (scored,)
        # Each token's request: index_add_ sums them in token order (one call per batch).
        out.index_add_(0, torch.tensor(batch, dtype=torch.long)[row_ids], per_token)
    return out


def _argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (ties go to the lowest index)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def choice_metrics(task: ChoiceRequests, loglikelihoods: torch.Tensor) -> ChoiceMetrics:
    """Metrics of ``task`` from every request's log-likelihood (``score_requests``' tensor,
    complete: all-reduced over the ranks that shared the work)."""
    values = loglikelihoods.tolist()
    if len(values) != len(task.requests):
        raise ValueError(
            f"{task.name}: {len(values)} log-likelihoods, {len(task.requests)} requests"
        )
    hits = {"acc": 0, "acc_per_token": 0, "acc_per_char": 0}
    gold_nats, gold_bytes = 0.0, 0
    per_example = []
    for i, example in enumerate(task.examples):
        lo, hi = task.offsets[i], task.offsets[i + 1]
        reqs, lls = task.requests[lo:hi], values[lo:hi]
        per_example.append(tuple(lls))
        hits["acc"] += _argmax(lls) == example.gold
        hits["acc_per_token"] += (
            _argmax([v / r.num_scored for v, r in zip(lls, reqs)]) == example.gold
        )
        hits["acc_per_char"] += (
            _argmax([v / r.num_chars for v, r in zip(lls, reqs)]) == example.gold
        )
        gold_nats -= lls[example.gold]
        gold_bytes += reqs[example.gold].num_bytes
    n = len(task.examples)
    return ChoiceMetrics(
        name=task.name,
        num_examples=n,
        num_truncated=task.num_truncated,
        acc=hits["acc"] / n if n else math.nan,
        acc_per_token=hits["acc_per_token"] / n if n else math.nan,
        acc_per_char=hits["acc_per_char"] / n if n else math.nan,
        bits_per_byte=gold_nats / math.log(2) / gold_bytes if gold_bytes else math.nan,
        loglikelihoods=tuple(per_example),
    )


def score_choice_task(
    model: Model,
    task: ChoiceRequests,
    *,
    batch_size: int,
    device: torch.device,
    pad_id: int = 0,
    group: Any = None,
    pp_group: Any = None,
    max_tokens: int = 0,
) -> ChoiceMetrics:
    """Score ``task`` on every rank of ``group`` (default: the world when a process group is
    initialized, else this process alone) and return the same metrics on all of them.

    Call on every rank with the same ``task``; each scores its share of the batches and the
    log-likelihoods are all-reduced (each request is scored by exactly one rank). Under
    pipeline parallelism ``model`` returns None on ranks without the last stage and the
    log-likelihoods are all-reduced over ``pp_group`` too."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    plan = plan_batches(task.requests, batch_size, max_tokens=max_tokens)  # packed: see there
    shard = shard_batches(plan, rank, world)
    loglikelihoods = score_requests(model, task.requests, shard, device=device, pad_id=pad_id)
    groups = ([group] if world > 1 else []) + ([] if pp_group is None else [pp_group])
    for reduce_over in groups:
        on_device = loglikelihoods.to(device)
        dist.all_reduce(on_device, group=reduce_over)
        loglikelihoods = on_device.cpu()
    return choice_metrics(task, loglikelihoods)
