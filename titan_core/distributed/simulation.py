"""One process standing in for a whole world: a fake process group plus a tensor mode.

``fake_backend``: collectives do nothing and tensors are ``FakeTensor``s (shapes, dtypes and
placements, no storage), so a 70B model's plan for 128 ranks builds and steps on a laptop.
``local_tensor``: tensors are ``LocalTensor``s holding every rank's value and collectives compute
their real result across them, so the numerics equal a real run's (TP; FSDP2 does not run).
This process plays rank 0; ``WORLD_SIZE``/``RANK`` are set as torchrun would for the trainer.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_core.errors import TitanError

_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


@dataclass
class Simulation:
    """The simulated world: its mode, size and the tensor mode that stands in for the ranks."""

    mode: str
    world_size: int
    fake_mode: FakeTensorMode | None = None
    local_mode: Any = None
    """The entered ``LocalTensorMode`` under local_tensor."""


_ACTIVE: Simulation | None = None


def active() -> Simulation | None:
    """The simulation this process runs in, if any."""
    return _ACTIVE


@contextlib.contextmanager
def simulated_world(mode: str, world_size: int) -> Iterator[Simulation]:
    """Start a fake process group of ``world_size`` ranks (this process is rank 0) and, for
    local_tensor, enter ``LocalTensorMode``; undo all of it (env included) on exit."""
    global _ACTIVE
    if os.environ.get("WORLD_SIZE", "1") != "1" or dist.is_initialized():
        raise TitanError(
            f"comm.mode: {mode} simulates every rank in one process; launch one process "
            "(COMM_MODE=... NGPU=N ./run_train.sh or titan train --ngpu N), not torchrun"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    sim = Simulation(mode, world_size)
    stack = contextlib.ExitStack()
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        if mode == "fake_backend":
            # Real (host) inputs such as the data batch are converted on entry.
            sim.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        elif mode == "local_tensor":
            from torch.distributed._local_tensor import LocalTensorMode

            sim.local_mode = stack.enter_context(LocalTensorMode(world_size))
        _ACTIVE = sim
        yield sim
    finally:
        _ACTIVE = None
        stack.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        _clear_dtensor_caches()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _clear_dtensor_caches() -> None:
    """Forget sharding decisions made on this world's meshes: DeviceMesh equality ignores
    process groups, so a later world's equal mesh would reuse the destroyed groups' names."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def materialize_context() -> contextlib.AbstractContextManager:
    """Where the trainer materializes and initializes parameters: fake tensors under
    fake_backend (no storage), a no-op otherwise."""
    if _ACTIVE is None or _ACTIVE.fake_mode is None:
        return contextlib.nullcontext()
    return _fake_materialize(_ACTIVE.fake_mode)


@contextlib.contextmanager
def _fake_materialize(fake_mode: FakeTensorMode) -> Iterator[None]:
    # torch's trunc_normal_ resamples until no value is out of bounds (`if not mask.any()`), a
    # data-dependent branch fake tensors cannot take; the inverse-CDF sampler has none.
    original = torch.nn.init.trunc_normal_
    torch.nn.init.trunc_normal_ = _trunc_normal_inverse_cdf
    try:
        with fake_mode:
            yield
    finally:
        torch.nn.init.trunc_normal_ = original


def _trunc_normal_inverse_cdf(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Truncated normal by the inverse CDF (torch <= 2.5's method): no data-dependent branch."""

    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    lo, hi = cdf((a - mean) / std), cdf((b - mean) / std)
    with torch.no_grad():
        tensor.uniform_(2 * lo - 1, 2 * hi - 1, generator=generator)
        tensor.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean)
        return tensor.clamp_(min=a, max=b)
