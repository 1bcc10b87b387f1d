"""Named Llama 3 training recipes, picked with ``--module llama3 --config <function name>``.

Each public function returns a complete ``JobConfig``; a TOML file and CLI overrides apply on top.
The model sizes themselves (``model.flavor``) are defined in ``flavors.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from titan_core.config.job import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)


def llama3_debugmodel() -> JobConfig:
    """A small Llama 3 that trains on a CPU in minutes; the default for smoke runs and docs."""
    return JobConfig(
        job=Job(dump_folder="./outputs/llama3_debugmodel", description="Llama 3 debug model"),
        model=Model(name="llama3", flavor="debugmodel"),
        training=Training(local_batch_size=8, seq_len=256, steps=200),
        optimizer=Optimizer(lr=8e-4),
        # Warmup-stable-decay: a continued run (a rerun of `make demo`) picks up at the peak lr.
        lr_scheduler=LRScheduler(
            warmup_steps=20, decay_ratio=0.2, decay_type="cosine", min_lr_factor=0.1
        ),
        # A full final save, so that a rerun resumes the optimizer and data position too.
        checkpoint=Checkpoint(
            enable=True, interval=50, keep_latest_k=3, last_save_model_only=False
        ),
        metrics=Metrics(log_freq=5),
        validation=Validation(enable=True, freq=50, steps=4),
    )


def llama3_debugmodel_tiny() -> JobConfig:
    """The debug recipe shrunk to a few seconds of CPU time, for fast tests."""
    cfg = llama3_debugmodel()
    return dataclasses.replace(
        cfg,
        job=dataclasses.replace(
            cfg.job,
            dump_folder="./outputs/llama3_debugmodel_tiny",
            description="Llama 3 tiny debug model",
        ),
        model=dataclasses.replace(cfg.model, flavor="debugmodel_tiny"),
        training=dataclasses.replace(cfg.training, local_batch_size=4, seq_len=64, steps=20),
        lr_scheduler=dataclasses.replace(cfg.lr_scheduler, warmup_steps=2),
        checkpoint=dataclasses.replace(cfg.checkpoint, interval=10),
        metrics=dataclasses.replace(cfg.metrics, log_freq=5),
        validation=dataclasses.replace(cfg.validation, freq=10, steps=2),
    )


def _llama3_gpu_recipe(
    flavor: str,
    *,
    lr: float,
    ac_mode: Literal["full", "selective"],
    local_batch_size: int = 1,
    seq_len: int = 8192,
    warmup_steps: int = 200,
    steps: int = 1000,
    tensor_parallel_degree: int = 1,
    compile_model: bool = False,
) -> JobConfig:
    """torchtitan's GPU recipe shape: bf16 FSDP params, AC, checkpoints every 500 steps."""
    name = f"llama3_{flavor.lower()}"
    return JobConfig(
        job=Job(dump_folder=f"./outputs/{name}", description=f"Llama 3 {flavor} training"),
        model=Model(name="llama3", flavor=flavor),
        training=Training(
            local_batch_size=local_batch_size,
            seq_len=seq_len,
            steps=steps,
            max_norm=1.0,
            mixed_precision_param="bfloat16",
            mixed_precision_reduce="float32",
        ),
        optimizer=Optimizer(lr=lr, eps=1e-8),
        lr_scheduler=LRScheduler(warmup_steps=warmup_steps),
        parallelism=Parallelism(
            data_parallel_shard_degree=-1, tensor_parallel_degree=tensor_parallel_degree
        ),
        checkpoint=Checkpoint(enable=True, interval=500, last_save_model_only=True),
        activation_checkpoint=ActivationCheckpoint(mode=ac_mode, selective_ac_option="op"),
        compile=Compile(enable=compile_model),
        profiling=Profiling(profile_freq=100),
        metrics=Metrics(log_freq=10),
    )


def llama3_1b() -> JobConfig:
    """Llama 3.2 1B on GPUs: FSDP over every rank, selective op AC."""
    return _llama3_gpu_recipe("1B", lr=3e-4, ac_mode="selective", local_batch_size=4)


def llama3_3b() -> JobConfig:
    """Llama 3.2 3B on GPUs: FSDP over every rank, selective op AC."""
    return _llama3_gpu_recipe("3B", lr=3e-4, ac_mode="selective", local_batch_size=2)


def llama3_8b() -> JobConfig:
    """torchtitan's Llama 3 8B recipe: batch 1 x 8192 tokens per rank, lr 3e-4, selective op AC."""
    return _llama3_gpu_recipe("8B", lr=3e-4, ac_mode="selective")


def llama3_70b() -> JobConfig:
    """torchtitan's Llama 3 70B recipe: TP 8 inside a node, FSDP across, full AC."""
    return _llama3_gpu_recipe(
        "70B", lr=1.5e-4, ac_mode="full", local_batch_size=8, tensor_parallel_degree=8
    )


def llama3_405b() -> JobConfig:
    """torchtitan's Llama 3 405B recipe: TP 8, full AC, compiled blocks (float8 left off)."""
    return _llama3_gpu_recipe(
        "405B",
        lr=8e-5,
        ac_mode="full",
        local_batch_size=2,
        warmup_steps=600,
        steps=3000,
        tensor_parallel_degree=8,
        compile_model=True,
    )
