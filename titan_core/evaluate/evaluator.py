"""Held-out loss, perplexity and bits per byte of a checkpoint, single process or under torchrun.

Definitions, over the scored tokens (every label of every (input, label) batch of the packed
validation stream, as training's validation loss sees them):

- ``loss`` = total_nats / num_tokens, the token-weighted mean cross entropy in nats/token;
- ``perplexity`` = exp(loss);
- ``bits_per_byte`` = total_nats / ln(2) / num_bytes, where num_bytes is the UTF-8 length of the
  text the scored label tokens decode to, each token counted by its own bytes and the bos/eos
  specials counted as 0 bytes. The nats still include the specials' predictions, so
  bits_per_byte = loss * num_tokens / num_bytes / ln(2) over exactly the tokens ``loss`` uses.

Under torchrun every rank reads the same stream and takes every world_size-th batch, so the
scored tokens, and the sums all-reduced from them, are those of a single process.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_core import storage
from titan_core.build import build_model_args
from titan_core.components.evaluators import Evaluation, build_evaluators, load_evaluations
from titan_core.components.validate import validation_data, validation_dataloader
from titan_core.config.dtypes import autocast_dtype
from titan_core.config.job import JobConfig
from titan_core.config.schema import apply_values
from titan_core.data import Tokenizer, build_dataloader, default_tokenizer_path
from titan_core.distributed.utils import destroy_process_group, init_distributed
from titan_core.errors import ConfigError, DataError
from titan_core.evaluate.generate import Sample, autocast_context, generate_samples
from titan_core.evaluate.harness import LmEvalOptions, check_inputs, run_lm_eval
from titan_core.evaluate.loading import (
    ResolvedCheckpoint,
    build_model,
    load_weights,
    resolve_checkpoint,
    resolve_config,
)
from titan_core.evaluate.report import EvalMetrics, build_report, write_report
from titan_core.logging import logger

Batch = tuple[torch.Tensor, ...]  # (inputs, labels), plus doc_ids under document masking


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """UTF-8 bytes each token id stands for, (n_words,) int64; special tokens count 0."""
    return torch.tensor(tokenizer.token_byte_counts(), dtype=torch.int64)


def count_text_bytes(labels: torch.Tensor, byte_lengths: torch.Tensor) -> int:
    """Bytes of the text that ``labels`` (any shape, token ids) represent, specials excluded."""
    return int(byte_lengths[labels.cpu()].sum())


def validation_loader(cfg: JobConfig, tokenizer: Tokenizer) -> Iterable[Batch]:
    """One finite pass over the job's validation split, unsplit (every rank reads all of it)."""
    data = validation_data(cfg)
    # A prepared dataset: the same checks, and the same masking the model was trained with.
    return build_dataloader(
        validation_dataloader(cfg),
        tokenizer=tokenizer,
        local_batch_size=data["local_batch_size"],
        seq_len=data["seq_len"],
        infinite=False,
    )


def forward_dtype(cfg: JobConfig, world_size: int) -> torch.dtype | None:
    """The autocast dtype for forward, or None (float32, or FSDP's own mixed precision)."""
    return autocast_dtype(cfg.training, fsdp=world_size > 1)


def rank_batches(
    batches: Iterable[Batch], rank: int, world_size: int
) -> Iterator[tuple[Batch, bool]]:
    """This rank's share, round-robin: ``(batch, counts)`` for every group of world_size batches.

    A rank left without a batch in the last group runs a copy of the group's first one with
    counts=False: FSDP's forward is collective, so every rank must run the same number.
    """
    stream = iter(batches)
    while group := list(itertools.islice(stream, world_size)):
        yield (group[rank], True) if rank < len(group) else (group[0], False)


@torch.no_grad()
def compute_metrics(
    model: nn.Module,
    batches: Iterable[Batch],
    byte_lengths: torch.Tensor,
    *,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    max_batches: int = 0,
) -> EvalMetrics:
    """Loss, perplexity and bits per byte over ``batches`` (the first ``max_batches`` if > 0).

    Under torchrun, call on every rank with the same ``batches``; sums are all-reduced.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if max_batches > 0:
        batches = itertools.islice(batches, max_batches)
    model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = num_bytes = num_batches = 0
    start = time.perf_counter()
    for (inputs, labels, *doc_ids), counts in rank_batches(batches, rank, world):
        # doc_ids (bs, seq) come with document masking: attention stays inside documents.
        masking = {"doc_ids": doc_ids[0].to(device)} if doc_ids else {}
        with autocast_context(device, autocast_dtype):
            logits = model(inputs.to(device), **masking)  # (bs, seq, vocab)
        if not counts:
            continue
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.to(device).flatten(), reduction="sum"
        )
        nats += loss_sum.double()  # stays on the device: no host sync per batch
        num_tokens += labels.numel()
        num_bytes += count_text_bytes(labels, byte_lengths)
        num_batches += 1
    # float64 holds integer counts exactly far beyond any eval's size.
    sums = torch.tensor([nats.item(), num_tokens, num_bytes, num_batches], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sums)
    seconds = time.perf_counter() - start
    total_nats, tokens, nbytes, nbatches = sums.tolist()
    loss = total_nats / tokens if tokens else math.nan
    return EvalMetrics(
        loss=loss,
        perplexity=math.exp(loss) if tokens else math.nan,
        bits_per_byte=total_nats / math.log(2) / nbytes if nbytes else math.nan,
        num_tokens=int(tokens),
        num_bytes=int(nbytes),
        num_batches=int(nbatches),
        eval_seconds=seconds,
        tokens_per_second=tokens / seconds if seconds > 0 else math.nan,
    )


@dataclass
class _Inputs:
    """Everything checked before a model is built."""

    ckpt: ResolvedCheckpoint
    cfg: JobConfig
    tokenizer: Tokenizer
    loader: Iterable[Batch]
    lm_eval: LmEvalOptions | None
    evaluations: list[Evaluation]


def lm_eval_options(cfg: JobConfig, hf_folder: str = "") -> LmEvalOptions | None:
    """The lm-eval run that ``evaluate.lm_eval_*`` asks for (on ``hf_folder``), or None."""
    ev = cfg.evaluate
    if not ev.lm_eval_tasks:
        if hf_folder:
            raise ConfigError("--hf-folder: lm-eval runs only with evaluate.lm_eval_tasks set")
        return None
    return LmEvalOptions(
        tasks=list(ev.lm_eval_tasks),
        task_dir=ev.lm_eval_task_dir,
        hf_folder=hf_folder,
        limit=ev.lm_eval_limit or None,
        batch_size=ev.lm_eval_batch_size,
    )


def _check_inputs(
    checkpoint: str,
    config_argv: Sequence[str],
    values: Mapping[str, Any],
    hf_folder: str,
    config: JobConfig | None = None,
) -> _Inputs:
    ckpt = resolve_checkpoint(checkpoint)
    cfg = config if config is not None else resolve_config(ckpt, list(config_argv))
    if values:
        cfg = apply_values(cfg, values)
    lm_eval = lm_eval_options(cfg, hf_folder)
    tokenizer = Tokenizer(cfg.tokenizer.path or str(default_tokenizer_path()))
    loader = validation_loader(cfg, tokenizer)  # fails here when the split is missing or empty
    evaluations = load_evaluations(cfg, tokenizer)  # [evaluators], as the trainer reads them
    max_seq_len = build_model_args(cfg, tokenizer.n_words).max_seq_len
    for prompt in cfg.evaluate.prompts:
        num = len(tokenizer.encode(prompt, bos=True, eos=False))
        if num > max_seq_len:
            raise ConfigError(
                f"evaluate.prompts: {prompt[:40]!r} is {num} tokens, more than the model's "
                f"max_seq_len {max_seq_len}"
            )
    if lm_eval is not None:
        lm_eval = replace(lm_eval, hf_folder=lm_eval.hf_folder or storage.join(ckpt.run_root, "hf"))
        check_inputs(lm_eval.hf_folder, lm_eval.task_dir, lm_eval.tasks)
    return _Inputs(ckpt, cfg, tokenizer, loader, lm_eval, evaluations)


def run_evaluators(
    model: nn.Module, inputs: _Inputs, device: torch.device, dtype: torch.dtype | None
) -> dict[str, float]:
    """The config's ``[evaluators]`` on the loaded checkpoint, as the trainer scores them in the
    loop (the same data, batching and numerics): ``eval/<name>/<metric>``, and
    ``eval/<name>/seconds``. Collective under torchrun."""
    if not inputs.evaluations:
        return {}
    evaluators = build_evaluators(
        inputs.cfg,
        inputs.tokenizer,
        device=device,
        forward_context=lambda: autocast_context(device, dtype),
        evaluations=inputs.evaluations,
    )
    scores = evaluators.run(model, inputs.ckpt.step)
    model.eval()  # ``run`` hands the model back in train mode, as training wants it
    return scores


def _score_and_sample(
    inputs: _Inputs, device: torch.device, world_size: int
) -> tuple[Any, EvalMetrics, list[Sample], dict[str, float], dict[str, float]]:
    """Build and load the model, score the validation split and the evaluators, and generate:
    (model args, metrics, samples, timing, evaluators' metrics). Collective under torchrun."""
    cfg, tokenizer = inputs.cfg, inputs.tokenizer
    start = time.perf_counter()
    model, args = build_model(cfg, tokenizer.n_words, device, world_size)
    load_weights(model, inputs.ckpt.step_dir, cfg.model.flavor)
    timing = {"load_s": time.perf_counter() - start}
    logger.info(
        "Loaded %s (step %d) in %.2fs; scoring %s split %r, world size %d",
        inputs.ckpt.step_dir,
        inputs.ckpt.step,
        timing["load_s"],
        validation_data(cfg)["dataset"],
        cfg.validation.dataset_split,
        world_size,
    )
    dtype = forward_dtype(cfg, world_size)
    table = token_byte_lengths(tokenizer)
    metrics = compute_metrics(
        model,
        inputs.loader,
        table,
        device=device,
        autocast_dtype=dtype,
        max_batches=cfg.evaluate.batches,
    )
    if metrics.num_tokens == 0:  # every rank sees the same sums, so all raise together
        data = validation_data(cfg)
        raise DataError(
            f"validation: dataset {data['dataset']!r} split {data['split']!r} has fewer than "
            f"training.seq_len + 1 = {data['seq_len'] + 1} tokens: nothing to score"
        )
    timing |= {"eval_s": metrics.eval_seconds, "tokens_per_s": metrics.tokens_per_second}
    start = time.perf_counter()
    scores = run_evaluators(model, inputs, device, dtype)
    if scores:
        timing["evaluators_s"] = time.perf_counter() - start
    start = time.perf_counter()
    samples = generate_samples(
        model,
        tokenizer,
        cfg.evaluate.prompts,
        max_new_tokens=cfg.evaluate.max_new_tokens,
        max_seq_len=args.max_seq_len,
        device=device,
        autocast_dtype=dtype,
    )
    timing["generate_s"] = time.perf_counter() - start
    return args, metrics, samples, timing, scores


def evaluate_checkpoint(
    checkpoint: str,
    *,
    config_argv: Sequence[str] = (),
    values: Mapping[str, Any] | None = None,
    output: str | None = None,
    hf_folder: str = "",
    config: JobConfig | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` as its job config's ``[evaluate]`` says and write
    ``<output>/eval/report.{json,md}`` (default output: the run root); returns the report.

    The config is ``config`` when given (a resolved job config, e.g. the pipeline's), else
    resolved from ``config_argv`` (see ``resolve_config``); then the dotted-key ``values`` are
    set (e.g. ``{"evaluate.batches": 2}``); lm-eval runs on ``hf_folder`` (default
    ``<run>/hf``). Every input is checked before the model is built."""
    start = time.perf_counter()
    inputs = _check_inputs(checkpoint, config_argv, values or {}, hf_folder, config)
    cfg = inputs.cfg
    if cfg.debug.num_threads:
        torch.set_num_threads(cfg.debug.num_threads)
    owns_group = not dist.is_initialized()
    # A folder the report cannot be written to is said before the model is scored, not after.
    where = "--output" if output else "--output (default: the checkpoint's run folder)"
    storage.check_writable(output or inputs.ckpt.run_root, where)
    info = init_distributed(cfg.comm.init_timeout_seconds, 0, "")
    try:
        args, metrics, samples, timing, scores = _score_and_sample(
            inputs, info.device, info.world_size
        )
    finally:
        if owns_group:
            destroy_process_group()
    # Only rank 0 goes on: the harness runs in one process, whatever world evaluated above.
    lm_results = None
    lm_eval = inputs.lm_eval
    if lm_eval is not None and info.is_rank0:
        lm_start = time.perf_counter()
        lm_results = run_lm_eval(
            lm_eval.hf_folder,
            lm_eval.task_dir,
            lm_eval.tasks,
            lm_eval.limit,
            batch_size=lm_eval.batch_size,
            bootstrap_iters=lm_eval.bootstrap_iters,
        )
        timing["lm_eval_s"] = time.perf_counter() - lm_start
    timing["total_s"] = time.perf_counter() - start
    settings = {
        **validation_data(cfg),
        "max_batches": cfg.evaluate.batches,
        "max_new_tokens": cfg.evaluate.max_new_tokens,
        "world_size": info.world_size,
        "device": info.device.type,
        "tokenizer": inputs.tokenizer.path,
    }
    report = build_report(
        ckpt=inputs.ckpt,
        cfg=cfg,
        model_args=args,
        metrics=metrics,
        samples=samples,
        timing=timing,
        settings=settings,
        lm_eval=lm_results,
        evaluators=scores,
    )
    if info.is_rank0:
        json_path, _ = write_report(output or inputs.ckpt.run_root, report)
        logger.info("Evaluation report written to %s (and report.md)", json_path)
    return report
