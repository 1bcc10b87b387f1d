"""Recipe builders the decoder families' config registries share (``--module M --config C``).

A family's registry calls these with its model name and label, so that e.g. ``qwen3_debugmodel``
trains with exactly the settings of ``llama3_debugmodel`` and every GPU recipe has one shape.
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


def debug_recipe(model: str, label: str) -> JobConfig:
    """Flavor ``debugmodel`` of family ``model``: trains on a CPU in minutes (smoke runs, docs)."""
    return JobConfig(
        job=Job(dump_folder=f"./outputs/{model}_debugmodel", description=f"{label} debug model"),
        model=Model(name=model, flavor="debugmodel"),
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


def tiny_recipe(model: str, label: str) -> JobConfig:
    """``debug_recipe`` shrunk to flavor ``debugmodel_tiny`` and a few seconds of CPU time."""
    cfg = debug_recipe(model, label)
    return dataclasses.replace(
        cfg,
        job=dataclasses.replace(
            cfg.job,
            dump_folder=f"./outputs/{model}_debugmodel_tiny",
            description=f"{label} tiny debug model",
        ),
        model=dataclasses.replace(cfg.model, flavor="debugmodel_tiny"),
        training=dataclasses.replace(cfg.training, local_batch_size=4, seq_len=64, steps=20),
        lr_scheduler=dataclasses.replace(cfg.lr_scheduler, warmup_steps=2),
        checkpoint=dataclasses.replace(cfg.checkpoint, interval=10),
        metrics=dataclasses.replace(cfg.metrics, log_freq=5),
        validation=dataclasses.replace(cfg.validation, freq=10, steps=2),
    )


def gpu_recipe(
    model: str,
    label: str,
    flavor: str,
    *,
    lr: float,
    ac_mode: Literal["full", "selective"],
    local_batch_size: int = 1,
    seq_len: int = 8192,
    warmup_steps: int = 200,
    steps: int = 1000,
    tensor_parallel_degree: int = 1,
    expert_parallel_degree: int = 1,
    compile_model: bool = False,
) -> JobConfig:
    """torchtitan's GPU recipe shape: bf16 FSDP params, AC, checkpoints every 500 steps."""
    name = f"{model}_{flavor.lower().replace('.', '_')}"
    return JobConfig(
        job=Job(dump_folder=f"./outputs/{name}", description=f"{label} {flavor} training"),
        model=Model(name=model, flavor=flavor),
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
            data_parallel_shard_degree=-1,
            tensor_parallel_degree=tensor_parallel_degree,
            expert_parallel_degree=expert_parallel_degree,
        ),
        checkpoint=Checkpoint(enable=True, interval=500, last_save_model_only=True),
        activation_checkpoint=ActivationCheckpoint(mode=ac_mode, selective_ac_option="op"),
        compile=Compile(enable=compile_model),
        profiling=Profiling(profile_freq=100),
        metrics=Metrics(log_freq=10),
    )
