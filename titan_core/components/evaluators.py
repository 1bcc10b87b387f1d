"""In-loop evaluators (``[evaluators]``): named held-out sets and downstream tasks, scored while
training every ``evaluators.freq`` steps and at the last step.

- A held-out set (``heldout``) is the first ``batches`` batches of a split, read once when the
  trainer starts (every rank reads all of them) and shared out round-robin over the
  data-parallel ranks at each evaluation: loss, perplexity and bits per byte over exactly the
  tokens one process would score, whatever the DP degree.
- A task (``task``) is a multiple-choice file scored as ranked choices
  (``ranked_choice.score_choice_task``): acc, acc_per_token, acc_per_char and bits per byte.

Evaluation touches nothing training reads: it has its own data, draws no random numbers (the
RNG states are restored around it all the same), and the model goes back to train mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_core.components.ranked_choice import (
    FEW_SHOT_SEED,
    ChoiceRequests,
    build_requests,
    score_choice_task,
    shard_batches,
)
from titan_core.config.job import (
    Dataloader,
    EvaluatorEntry,
    JobConfig,
    parse_evaluators,
)
from titan_core.config.job import Evaluators as EvaluatorsConfig
from titan_core.data import Tokenizer, build_dataloader, is_local_dataset
from titan_core.data.assets import bundled_tasks_dir, ensure_assets
from titan_core.data.bundled_tasks import BUILDERS
from titan_core.data.choice_tasks import ChoiceExample, read_choice_task, read_harness_task
from titan_core.errors import ConfigError, DataError, TitanError, first_line
from titan_core.logging import logger

Batch = tuple[torch.Tensor, ...]  # (inputs, labels), plus doc_ids under document masking
# A plain lowercase name is a bundled task; a task file is a path or URL (a "/" or a suffix).
_BUNDLED_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class HeldOutSet:
    """A held-out set's batches, the same on every rank."""

    name: str
    batches: tuple[Batch, ...]


@dataclass(frozen=True)
class ChoiceTask:
    """A downstream task's requests, tokenized once."""

    name: str
    requests: ChoiceRequests


Evaluation = HeldOutSet | ChoiceTask


def heldout_dataloader(cfg: JobConfig, entry: EvaluatorEntry) -> Dataloader:
    """``cfg.dataloader`` reading a held-out set: its source and split (default validation), in
    order, without the training data's mix, streams, exclusions or prefetch thread."""
    source = entry.source
    return dataclasses.replace(
        cfg.dataloader,
        dataset=source,
        path=source if is_local_dataset(source) else "",
        split=str(entry.option("split", "validation")),
        mix=[],
        streams=0,
        shuffle=False,
        exclude=[],
        prefetch=0,
    )


def load_heldout(
    cfg: JobConfig, entry: EvaluatorEntry, tokenizer: Tokenizer, batch_size: int, limit: int
) -> tuple[Batch, ...]:
    """The first ``limit`` batches of a held-out set (fewer when the split is shorter);
    DataError when it holds none."""
    data = heldout_dataloader(cfg, entry)
    loader = build_dataloader(
        data,
        tokenizer=tokenizer,
        local_batch_size=batch_size,
        seq_len=cfg.training.seq_len,
        infinite=False,
    )
    stream = iter(loader)
    try:  # copies: a loader may hand out views of its own buffers
        batches = tuple(tuple(t.clone() for t in b) for b in itertools.islice(stream, limit))
    finally:
        if hasattr(stream, "close"):
            stream.close()
    if not batches:
        raise DataError(
            f"{entry.source}: split {data.split!r} holds no batch of {batch_size} sequences of "
            f"{cfg.training.seq_len + 1} tokens (lower evaluators.batch_size)"
        )
    return batches


def _task_files(entry: EvaluatorEntry) -> tuple[str, str]:
    """(examples URL, shots URL or "") of a task entry: a bundled task's files (built with the
    assets when missing), else the source and its ``shots`` option."""
    shots = str(entry.option("shots", ""))
    if not _BUNDLED_NAME.fullmatch(entry.source):
        return entry.source, shots
    if entry.source not in BUILDERS:
        raise ConfigError(
            f"unknown bundled task {entry.source!r} (bundled: {', '.join(BUILDERS)}; a task "
            "file is a path or URL such as ./tasks/mine.jsonl)"
        )
    if "format" in entry.options:
        raise ConfigError("format: bundled tasks are task files already; it is for task files")
    folder = bundled_tasks_dir() / entry.source
    if not (folder / "test.jsonl").exists():
        ensure_assets()  # assets built before the tasks existed gain them (seconds)
    return str(folder / "test.jsonl"), shots or str(folder / "shots.jsonl")


def read_task(cfg: JobConfig, entry: EvaluatorEntry, tokenizer: Tokenizer) -> ChoiceRequests:
    """A task entry's requests: its examples (``examples=N``: a fixed subset of N, drawn with
    ``seed``) and ``num_shots`` shots drawn with ``seed``, contexts cut from the left to fit
    ``training.seq_len``; tokenized here, once."""
    examples_url, shots_url = _task_files(entry)
    fmt = str(entry.option("format", ""))
    num_shots = int(entry.option("num_shots", 0))
    if num_shots and not shots_url:
        raise ConfigError(f"num_shots={num_shots} needs shots=URL, a file to draw them from")

    def read(url: str) -> list[ChoiceExample]:
        return read_harness_task(url, fmt) if fmt else read_choice_task(url)

    seed = int(entry.option("seed", FEW_SHOT_SEED))
    return build_requests(
        entry.name,
        subset_examples(read(examples_url), int(entry.option("examples", 0)), seed),
        tokenizer,
        max_seq_len=cfg.training.seq_len,
        shots=read(shots_url) if num_shots else (),
        num_shots=num_shots,
        seed=seed,
    )


def subset_examples(examples: list[ChoiceExample], n: int, seed: int) -> list[ChoiceExample]:
    """``n`` of ``examples`` drawn by ``random.Random(seed)``, in their file order (all of them
    when ``n`` is 0 or at least their number): the same subset at every evaluation and run."""
    if not n or n >= len(examples):
        return examples
    return [examples[i] for i in sorted(random.Random(seed).sample(range(len(examples)), n))]


def eval_batch_size(cfg: JobConfig) -> int:
    """Sequences per forward on each rank (``evaluators.batch_size``, -1: training's)."""
    size = cfg.evaluators.batch_size
    return size if size > 0 else cfg.training.local_batch_size


def load_evaluations(
    cfg: JobConfig, tokenizer: Tokenizer, *, check: bool = False
) -> list[Evaluation]:
    """Every evaluator of ``evaluators.sets``, read, in order; a ConfigError line naming the
    evaluator when one cannot be (``check``: a held-out set's first batch only)."""
    out: list[Evaluation] = []
    batch_size = eval_batch_size(cfg)
    for entry in parse_evaluators(cfg.evaluators.sets):
        try:
            if entry.kind == "task":
                out.append(ChoiceTask(entry.name, read_task(cfg, entry, tokenizer)))
            else:
                limit = 1 if check else int(entry.option("batches", cfg.evaluators.batches))
                batches = load_heldout(cfg, entry, tokenizer, batch_size, limit)
                out.append(HeldOutSet(entry.name, batches))
        except TitanError as e:
            why = first_line(e)  # named once: scoring's own errors start with the name
            why = why if why.startswith(f"{entry.name}: ") else f"{entry.name}: {why}"
            raise ConfigError(f"evaluators.sets: {why}") from None
    return out


def check_evaluators(cfg: JobConfig, tokenizer: Tokenizer) -> None:
    """Read every evaluator's source before anything starts: task files whole (a bad line, a
    gold index out of range, an unknown bundled task), a held-out set's first batch."""
    load_evaluations(cfg, tokenizer, check=True)


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore torch's (CPU and ``device``'s), Python's and NumPy's RNG states on exit, so that
    whatever runs inside cannot move training's random streams."""
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


@torch.no_grad()
def score_heldout(
    model: Callable[..., torch.Tensor | None],
    batches: tuple[Batch, ...],
    byte_lengths: torch.Tensor,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Loss, perplexity and bits per byte of ``batches`` (``titan eval``'s definitions), each
    rank scoring every world-size-th batch of ``group``; the same numbers on every rank.

    Under pipeline parallelism ``model`` returns None on ranks without the last stage, which
    count nothing; the sums are then all-reduced over ``pp_group`` too."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    nats = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = num_bytes = 0
    for (index,), counts in shard_batches([[i] for i in range(len(batches))], rank, world):
        inputs, labels, *doc_ids = batches[index]
        masking = {"doc_ids": doc_ids[0].to(device)} if doc_ids else {}
        logits = model(inputs.to(device), **masking)  # (bs, seq, vocab)
        if not counts or logits is None:  # a rerun that keeps FSDP's forwards in step
            continue
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.to(device).flatten(), reduction="sum"
        )
        nats += loss_sum.double()
        num_tokens += labels.numel()
        num_bytes += int(byte_lengths[labels].sum())
    counts_of = torch.tensor([num_tokens, num_bytes], dtype=torch.float64, device=device)
    sums = torch.cat([nats[None], counts_of])  # float64 holds the counts exactly
    if world > 1:
        dist.all_reduce(sums, group=group)
    if pp_group is not None:  # the last stage's sums, to every stage's ranks
        dist.all_reduce(sums, group=pp_group)
    total_nats, tokens, nbytes = sums.tolist()
    loss = total_nats / tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total_nats / math.log(2) / nbytes if nbytes else math.nan,
    }


class Evaluators:
    """The job's evaluators: due every ``freq`` steps and at the last step; ``run`` scores them
    all in their order and returns ``eval/<name>/<metric>`` (and ``eval/<name>/seconds``), the
    same on every rank of ``group``."""

    def __init__(
        self,
        cfg: EvaluatorsConfig,
        evaluations: list[Evaluation],
        *,
        batch_size: int,
        byte_lengths: torch.Tensor,
        device: torch.device,
        pad_id: int,
        group: dist.ProcessGroup | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        forward: Callable[..., torch.Tensor | None] | None = None,
        pp_group: dist.ProcessGroup | None = None,
        max_tokens: int = 0,
    ) -> None:
        self.cfg = cfg
        self.evaluations = evaluations
        self.batch_size = batch_size
        self.byte_lengths = byte_lengths
        self.device = device
        self.pad_id = pad_id
        self.group = group
        self.forward_context = forward_context
        self.forward = forward  # whole logits under TP, CP and PP (the trainer's); else model
        self.pp_group = pp_group
        self.max_tokens = max_tokens  # a task's short requests packed up to this many tokens

    def due(self, step: int, last: bool) -> bool:
        """Every ``freq`` steps, and at the last step."""
        return bool(self.evaluations) and (last or step % self.cfg.freq == 0)

    def _score(self, model: nn.Module, evaluation: Evaluation) -> dict[str, float]:
        def forward(inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | None:
            with self.forward_context():  # the training forward's autocast, if any
                return (self.forward or model)(inputs, **kwargs)

        if isinstance(evaluation, HeldOutSet):
            return score_heldout(
                forward,
                evaluation.batches,
                self.byte_lengths,
                device=self.device,
                group=self.group,
                pp_group=self.pp_group,
            )
        metrics = score_choice_task(
            forward,
            evaluation.requests,
            batch_size=self.batch_size,
            device=self.device,
            pad_id=self.pad_id,
            group=self.group,
            pp_group=self.pp_group,
            max_tokens=self.max_tokens,
        )
        keys = ("acc", "acc_per_token", "acc_per_char", "bits_per_byte")
        return {k: float(getattr(metrics, k)) for k in keys}

    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        """Score every evaluator on ``model`` (in eval mode, without gradients; back in train
        mode after) and log one line each."""
        out: dict[str, float] = {}
        model.eval()
        try:
            with preserved_rng(self.device), torch.no_grad():
                for evaluation in self.evaluations:
                    start = time.perf_counter()
                    metrics = self._score(model, evaluation)
                    metrics["seconds"] = time.perf_counter() - start
                    prefix = f"eval/{evaluation.name}/"
                    out |= {prefix + k: v for k, v in metrics.items()}
                    shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "seconds")
                    logger.info(
                        "step: %5d  eval %s: %s  (%.1fs)",
                        step,
                        evaluation.name,
                        shown,
                        metrics["seconds"],
                    )
        finally:
            model.train()
        return out


def build_evaluators(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    evaluations: list[Evaluation] | None = None,
    forward: Callable[..., torch.Tensor | None] | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> Evaluators:
    """The job's evaluators, their data read and tokenized once (``load_evaluations``; or
    ``evaluations``, read already)."""
    if evaluations is None:
        evaluations = load_evaluations(cfg, tokenizer)
    for e in evaluations:
        if isinstance(e, ChoiceTask) and e.requests.num_truncated:
            logger.warning(
                "evaluator %s: %d of %d examples cut from the left to fit training.seq_len %d",
                e.name,
                e.requests.num_truncated,
                len(e.requests.examples),
                cfg.training.seq_len,
            )
    return Evaluators(
        cfg.evaluators,
        evaluations,
        batch_size=eval_batch_size(cfg),
        byte_lengths=torch.tensor(tokenizer.token_byte_counts(), dtype=torch.int64),
        device=device,
        pad_id=tokenizer.pad_id,
        group=group,
        forward_context=forward_context,
        forward=forward,
        pp_group=pp_group,
        max_tokens=eval_batch_size(cfg) * cfg.training.seq_len,  # training's tokens per forward
    )
