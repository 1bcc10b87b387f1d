"""Named DeepSeek-V3 training recipes, picked with ``--module deepseek_v3 --config <function>``.

Each public function returns a complete ``JobConfig``; a TOML file and CLI overrides apply on top.
The debug recipes train exactly as the other families' do (``models.common.recipes``); the model
sizes (``model.flavor``) are defined in ``flavors.py``.
"""

from __future__ import annotations

import functools

from titan_core.config.job import JobConfig
from titan_core.models.common.recipes import debug_recipe, gpu_recipe, tiny_recipe

_deepseek_v3_gpu_recipe = functools.partial(
    gpu_recipe, "deepseek_v3", "DeepSeek-V3", ac_mode="full"
)


def deepseek_v3_debugmodel() -> JobConfig:
    """A small DeepSeek-V3 (MLA, 8 experts in 4 groups, one MTP depth) for a CPU in minutes."""
    return debug_recipe("deepseek_v3", "DeepSeek-V3")


def deepseek_v3_debugmodel_tiny() -> JobConfig:
    """The debug recipe shrunk to a few seconds of CPU time, for fast tests."""
    return tiny_recipe("deepseek_v3", "DeepSeek-V3")


def deepseek_v3_16b_a3b() -> JobConfig:
    """Moonlight-16B-A3B's shape on GPUs: experts over 8 ranks (EP 8), FSDP across, full AC."""
    return _deepseek_v3_gpu_recipe("16B-A3B", lr=2.2e-4, expert_parallel_degree=8)


def deepseek_v3_671b_a37b() -> JobConfig:
    """DeepSeek-V3 671B-A37B: experts over 64 ranks (EP 64), FSDP across, full AC, 4096
    tokens (its pre-training context; YaRN extends it)."""
    return _deepseek_v3_gpu_recipe("671B-A37B", lr=2.2e-4, seq_len=4096, expert_parallel_degree=64)


def deepseek_v3_1t_a32b() -> JobConfig:
    """Kimi K2 1T-A32B's shape: experts over 64 ranks (EP 64), FSDP across, full AC."""
    return _deepseek_v3_gpu_recipe("1T-A32B", lr=2e-4, seq_len=4096, expert_parallel_degree=64)
