"""Optimizer, LR schedule, clipping and parallel-dims validation against torch's own pieces."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR

from titan_core.components.lr_scheduler import LRSchedulerState, build_lr_scheduler
from titan_core.components.optimizer import build_optimizer
from titan_core.config.job import LRScheduler, Optimizer, Parallelism
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.distributed.utils import clip_grad_norm_
from titan_core.errors import ConfigError
from titan_core.logging import logger


def _lrs(sched: torch.optim.lr_scheduler.LRScheduler, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


def _opt(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_matches_torch_linear_lr() -> None:
    ours = build_lr_scheduler(_opt(), LRScheduler(warmup_steps=10, decay_ratio=0.0), 50)
    ref = LinearLR(_opt(), start_factor=1 / 11, end_factor=1.0, total_iters=10)
    assert _lrs(ours, 10) == pytest.approx(_lrs(ref, 10), rel=1e-12)


def test_cosine_decay_matches_torch_cosine_annealing() -> None:
    # After warmup, ours is torch's CosineAnnealingLR one step ahead: it lands on the minimum at
    # the last training step instead of one step after it.
    w, steps, min_f = 5, 45, 0.1
    ours = _lrs(
        build_lr_scheduler(
            _opt(), LRScheduler(warmup_steps=w, decay_type="cosine", min_lr_factor=min_f), steps
        ),
        steps,
    )
    ref_sched = CosineAnnealingLR(_opt(), T_max=steps - w, eta_min=min_f)
    ref = _lrs(ref_sched, steps - w + 1)
    assert ours[w:] == pytest.approx(ref[1:], rel=1e-9)
    assert ours[-1] == pytest.approx(min_f)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_wsd_shape(decay_type: str) -> None:
    cfg = LRScheduler(warmup_steps=4, decay_ratio=0.25, decay_type=decay_type, min_lr_factor=0.2)
    lrs = _lrs(build_lr_scheduler(_opt(2.0), cfg, 40), 40)
    assert lrs[3] == pytest.approx(2.0 * 4 / 5)
    assert all(lr == pytest.approx(2.0) for lr in lrs[4:30])  # stable phase
    assert all(a >= b for a, b in itertools.pairwise(lrs[30:]))  # monotone decay
    assert lrs[-1] == pytest.approx(0.4)
    if decay_type == "linear":
        assert lrs[34] == pytest.approx(2.0 * (0.2 + 0.8 * (1 - 5 / 10)))
    if decay_type == "sqrt":
        assert lrs[34] == pytest.approx(2.0 * (0.2 + 0.8 * (1 - math.sqrt(5 / 10))))


def test_scheduler_state_roundtrip() -> None:
    cfg = LRScheduler(warmup_steps=3, decay_type="cosine")
    a = build_lr_scheduler(_opt(), cfg, 20)
    full = _lrs(a, 20)
    b = build_lr_scheduler(_opt(), cfg, 20)
    _lrs(b, 7)
    state = LRSchedulerState(b).state_dict()
    c = build_lr_scheduler(_opt(), cfg, 20)
    LRSchedulerState(c).load_state_dict(state)
    assert _lrs(c, 13) == full[7:]


def test_warmup_longer_than_training_is_cut_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A recipe's long warmup on a short run warms up over the whole run (torchtitan's rule),
    with one warning naming both keys, instead of refusing the run."""
    logger.addHandler(caplog.handler)  # the titan logger does not propagate
    try:
        sched = build_lr_scheduler(_opt(), LRScheduler(warmup_steps=30), 4)
    finally:
        logger.removeHandler(caplog.handler)
    assert _lrs(sched, 4) == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    # A set: before init_logger the record also propagates to caplog's root handler.
    warnings = {r.getMessage() for r in caplog.records if r.levelname == "WARNING"}
    assert warnings == {
        "lr_scheduler.warmup_steps 30 exceeds training.steps 4: warming up over all 4 steps instead"
    }


def test_optimizer_matches_torch_adamw() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8)
    b = torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    cfg = Optimizer(lr=1e-2, weight_decay=0.05, implementation="for-loop")
    ours = build_optimizer(a, cfg)
    ref = torch.optim.AdamW(
        b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, foreach=False
    )
    x = torch.randn(4, 8)
    for _ in range(5):
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_clip_grad_norm_matches_torch() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert torch.equal(ours, ref)
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)
    unclipped = clip_grad_norm_(a, 0.0)  # 0 = report only
    assert unclipped.item() == pytest.approx(1.0, rel=1e-5)


def test_parallel_dims_validation() -> None:
    dims = ParallelDims.from_config(Parallelism(data_parallel_replicate_degree=2), 8)
    assert dims.dp_shard == 4 and dims.dp_degree == 8
    with pytest.raises(ConfigError, match="world size 6"):
        ParallelDims.from_config(Parallelism(tensor_parallel_degree=4), 6)
    with pytest.raises(ConfigError, match="!= world size 4"):
        ParallelDims.from_config(Parallelism(data_parallel_shard_degree=3), 4)
    tp = ParallelDims.from_config(Parallelism(tensor_parallel_degree=2), 2)
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):
        tp.validate_model(n_heads=4, n_kv_heads=1, n_layers=2)
    pp = ParallelDims.from_config(Parallelism(pipeline_parallel_degree=4), 4)
    with pytest.raises(ConfigError, match="exceeds the number of layers"):
        pp.validate_model(n_heads=4, n_kv_heads=4, n_layers=2)


# ------------------------------------------------------------------ the MFU peak
_XEON = {"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "fma avx avx2 avx512f",
         "model name": "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", "cpu MHz": "1000.0"}  # fmt: skip


@pytest.mark.parametrize(
    ("info", "dtype", "per_cycle"),
    [
        (_XEON, torch.float32, 64),  # AVX-512: 16 lanes x 2 FMA pipes x 2 FLOPs
        (_XEON | {"flags": "fma avx avx2"}, torch.float32, 32),  # AVX2
        (_XEON | {"flags": "avx"}, torch.float32, 16),  # no FMA: a mul and an add pipe
        (_XEON | {"vendor_id": "AuthenticAMD", "cpu family": "25"}, torch.float32, 32),  # Zen 4
        (_XEON | {"vendor_id": "AuthenticAMD", "cpu family": "26"}, torch.float32, 64),  # Zen 5
        (_XEON | {"flags": "fma avx avx2 avx512f avx512_bf16"}, torch.bfloat16, 128),
        (_XEON | {"flags": "fma avx avx2 avx512f amx_bf16"}, torch.bfloat16, 1024),
        (_XEON, torch.float64, 32),
    ],
)
def test_the_cpu_peak_is_cores_x_clock_x_flops_per_cycle(
    info: dict[str, str], dtype: torch.dtype, per_cycle: int
) -> None:
    """A stable property of the CPU, not a measurement that load can make low: the model
    name's clock (cpuinfo's current MHz is only the fallback), the vector width's FLOPs."""
    import os

    from titan_core.components.metrics import cpu_peak_tflops

    peak = cpu_peak_tflops(dtype, 1, info)
    assert peak.tflops == pytest.approx(2.4e9 * per_cycle / 1e12)
    assert peak.source.startswith(f"1 core x 2.40 GHz x {per_cycle} FLOP/cycle")
    cores = len(os.sched_getaffinity(0))  # more threads than cores count the cores
    assert cpu_peak_tflops(dtype, 1000, info).tflops == pytest.approx(cores * peak.tflops)


def test_an_mfu_above_100_percent_comes_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A peak too low for the device (here a configured one) is named, once, the first time
    MFU passes 100%."""
    import logging

    from titan_core.components.metrics import MemoryMonitor, MetricsProcessor
    from titan_core.config.job import Metrics

    proc = MetricsProcessor(
        Metrics(), 10**12, 1e-9, MemoryMonitor(torch.device("cpu")), [],
        peak_source="metrics.cpu_peak_tflops",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for step in (1, 2):
            proc.add_step(100)
            assert proc.log(step, 1.0, 1.0, 1e-3)["mfu_pct"] > 100
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        len(warnings) == 1
        and "is above 100%: the peak it divides by (1e-09 TFLOP/s: " in (warnings[0])
    ), warnings
    assert "metrics.cpu_peak_tflops) is too low for this device" in warnings[0]
