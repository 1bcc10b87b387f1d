"""Named Qwen3-MoE training recipes, picked with ``--module qwen3_moe --config <function name>``.

Each public function returns a complete ``JobConfig``; a TOML file and CLI overrides apply on top.
The debug recipes train exactly as the dense families' do (``models.common.recipes``); the model
sizes (``model.flavor``) are defined in ``flavors.py``.
"""

from __future__ import annotations

import functools

from titan_core.config.job import JobConfig
from titan_core.models.common.recipes import debug_recipe, gpu_recipe, tiny_recipe

_qwen3_moe_gpu_recipe = functools.partial(gpu_recipe, "qwen3_moe", "Qwen3-MoE", ac_mode="full")


def qwen3_moe_debugmodel() -> JobConfig:
    """A small Qwen3-MoE (8 experts, top-2) that trains on a CPU in minutes."""
    return debug_recipe("qwen3_moe", "Qwen3-MoE")


def qwen3_moe_debugmodel_tiny() -> JobConfig:
    """The debug recipe shrunk to a few seconds of CPU time, for fast tests."""
    return tiny_recipe("qwen3_moe", "Qwen3-MoE")


def qwen3_moe_30b_a3b() -> JobConfig:
    """Qwen3-30B-A3B on GPUs: experts over 8 ranks (EP 8), FSDP across, full AC."""
    return _qwen3_moe_gpu_recipe("30B-A3B", lr=3e-4, expert_parallel_degree=8)


def qwen3_moe_235b_a22b() -> JobConfig:
    """Qwen3-235B-A22B: TP 4 inside a node, experts over 8 ranks, FSDP across, full AC."""
    return _qwen3_moe_gpu_recipe(
        "235B-A22B", lr=1.5e-4, tensor_parallel_degree=4, expert_parallel_degree=8
    )
