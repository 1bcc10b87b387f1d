"""float8 training through torchao: config checks, Linear conversion, and the float8 TP styles.

torchao is an optional dependency and float8 matmuls need CUDA SM89+ (Ada/Hopper), so every
problem is reported as one ``ConfigError`` line by ``check_float8`` before anything launches.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan_core.config.job import Float8 as Float8Config
from titan_core.errors import ConfigError
from titan_core.logging import logger


def float8_enabled(cfg: Float8Config) -> bool:
    """Whether any float8 option is on."""
    return bool(cfg.recipe_name) or cfg.enable_fsdp_float8_all_gather


def check_float8(cfg: Float8Config, device_type: str) -> None:
    """Refuse float8 where it cannot run: not CUDA, torchao missing, GPU older than SM89."""
    if not float8_enabled(cfg):
        return
    if device_type != "cuda":
        raise ConfigError(
            f"float8.recipe_name: {cfg.recipe_name!r} needs CUDA (SM89+) and torchao; "
            f"device is {device_type}, leave float8.recipe_name empty and "
            "float8.enable_fsdp_float8_all_gather false"
        )
    if cfg.enable_fsdp_float8_all_gather and cfg.recipe_name != "tensorwise":
        raise ConfigError(
            "float8.enable_fsdp_float8_all_gather: needs float8.recipe_name 'tensorwise', "
            f"got {cfg.recipe_name!r}"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"float8.recipe_name: {cfg.recipe_name!r} needs torchao, which is not installed "
            "(pip install torchao)"
        )
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise ConfigError(
            f"float8.recipe_name: float8 matmuls need a GPU with compute capability >= 8.9, "
            f"this one is {capability[0]}.{capability[1]}"
        )


def convert_to_float8(model: nn.Module, cfg: Float8Config) -> None:
    """Swap eligible ``nn.Linear`` modules for torchao ``Float8Linear`` in place.

    Skipped: names containing any of ``cfg.filter_fqns`` (the output projection by default) and
    layers whose dims are not multiples of 16 (a float8 matmul requirement).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe_name == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(cfg.recipe_name)
    skipped: list[str] = []

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(part in fqn for part in cfg.filter_fqns):
            skipped.append(fqn)
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    logger.info("float8 (%s recipe) applied; kept in high precision: %s", cfg.recipe_name, skipped)


def tp_styles(cfg: Float8Config) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) TP style classes; the float8 variants for tensorwise
    float8, which all-gather activations in float8."""
    if cfg.recipe_name == "tensorwise":
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput
