"""Named Qwen3 training recipes, picked with ``--module qwen3 --config <function name>``.

Each public function returns a complete ``JobConfig``; a TOML file and CLI overrides apply on top.
The debug recipes train exactly as Llama 3's do; the GPU recipes have the same shape
(``models.common.recipes``). The model sizes (``model.flavor``) are defined in ``flavors.py``.
"""

from __future__ import annotations

import functools

from titan_core.config.job import JobConfig
from titan_core.models.common.recipes import debug_recipe, gpu_recipe, tiny_recipe

_qwen3_gpu_recipe = functools.partial(gpu_recipe, "qwen3", "Qwen3")


def qwen3_debugmodel() -> JobConfig:
    """A small Qwen3 (QK-norm, head_dim apart from dim) that trains on a CPU in minutes."""
    return debug_recipe("qwen3", "Qwen3")


def qwen3_debugmodel_tiny() -> JobConfig:
    """The debug recipe shrunk to a few seconds of CPU time, for fast tests."""
    return tiny_recipe("qwen3", "Qwen3")


def qwen3_0_6b() -> JobConfig:
    """Qwen3 0.6B on GPUs: FSDP over every rank, selective op AC."""
    return _qwen3_gpu_recipe("0.6B", lr=3e-4, ac_mode="selective", local_batch_size=4)


def qwen3_1_7b() -> JobConfig:
    """Qwen3 1.7B on GPUs: FSDP over every rank, selective op AC."""
    return _qwen3_gpu_recipe("1.7B", lr=3e-4, ac_mode="selective", local_batch_size=4)


def qwen3_4b() -> JobConfig:
    """Qwen3 4B on GPUs: FSDP over every rank, selective op AC."""
    return _qwen3_gpu_recipe("4B", lr=3e-4, ac_mode="selective", local_batch_size=2)


def qwen3_8b() -> JobConfig:
    """Qwen3 8B on GPUs: batch 1 x 8192 tokens per rank, lr 3e-4, selective op AC."""
    return _qwen3_gpu_recipe("8B", lr=3e-4, ac_mode="selective")


def qwen3_14b() -> JobConfig:
    """Qwen3 14B on GPUs: FSDP over every rank, full AC."""
    return _qwen3_gpu_recipe("14B", lr=3e-4, ac_mode="full")


def qwen3_32b() -> JobConfig:
    """Qwen3 32B: TP 8 inside a node, FSDP across, full AC."""
    return _qwen3_gpu_recipe(
        "32B", lr=1.5e-4, ac_mode="full", local_batch_size=2, tensor_parallel_degree=8
    )
