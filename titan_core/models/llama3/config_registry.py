"""Named Llama 3 training recipes, picked with ``--module llama3 --config <function name>``.

Each public function returns a complete ``JobConfig``; a TOML file and CLI overrides apply on top.
The model sizes themselves (``model.flavor``) are defined in ``flavors.py``; the recipe shapes
are shared with the other decoder families (``models.common.recipes``).
"""

from __future__ import annotations

import functools

from titan_core.config.job import JobConfig
from titan_core.models.common.recipes import debug_recipe, gpu_recipe, tiny_recipe

_llama3_gpu_recipe = functools.partial(gpu_recipe, "llama3", "Llama 3")


def llama3_debugmodel() -> JobConfig:
    """A small Llama 3 that trains on a CPU in minutes; the default for smoke runs and docs."""
    return debug_recipe("llama3", "Llama 3")


def llama3_debugmodel_tiny() -> JobConfig:
    """The debug recipe shrunk to a few seconds of CPU time, for fast tests."""
    return tiny_recipe("llama3", "Llama 3")


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
