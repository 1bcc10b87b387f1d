"""Pipeline parallelism: every schedule against one process, FSDP composition, checkpoints that
move between PP and a single process, the stage split, and one-line errors for bad configs.

Parity runs use the harness (tests/parallel_harness.py): one seed checkpoint, fp32,
deterministic, 4 layers, local batch 4 split into microbatches of 1. Tolerance 1e-5 relative:
the pipeline averages the loss per microbatch (mean of means) instead of over the whole batch, so
only the last bits change (measured ~1e-7). Three steps: step 1 checks the forward, steps 2-3 the
gradients, which are clipped (grad norm ~7 > max_norm 1), so the norm summed over stages matters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from parallel_harness import MODEL, assert_parity, run_layout, train_layout

from titan_core.distributed.pipeline_parallel import (
    SCHEDULES,
    ModelPartsView,
    split_module,
    stage_ids_this_rank,
)
from titan_core.errors import ConfigError
from titan_core.models import get_flavor, get_model_spec
from titan_core.models.common.pipeline import plan_pipeline
from titan_core.resolve import parse_args
from titan_core.trainer import Trainer

STEPS = 3
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
SCHED = "--parallelism.pipeline_parallel_schedule"
SPLIT = "--parallelism.pipeline_parallel_split_points"
PER_STAGE = "--parallelism.pipeline_parallel_layers_per_stage"
MB = "--parallelism.pipeline_parallel_microbatch_size"
VALIDATE = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]


def _metrics(dump: Path) -> dict[int, dict]:
    """metrics.jsonl rows merged by step (training and validation rows)."""
    rows: dict[int, dict] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(int(row["step"]), {}).update(row)
    return rows


def _assert_close(got: dict[int, dict], ref: dict[int, dict], key: str, what: str) -> None:
    steps = [s for s in sorted(ref) if key in ref[s]]
    assert steps, f"{what}: the reference logged no {key}"
    for step in steps:
        a, b = got[step][key], ref[step][key]
        assert abs(a - b) <= 1e-5 * abs(b), f"{what} step {step} {key}: {a!r} vs {b!r}"


@pytest.fixture(scope="module")
def pp_reference(tmp_path_factory: pytest.TempPathFactory, parity_seed: Path) -> dict[int, dict]:
    """One process, STEPS steps with validation: losses, grad norms and validation losses."""
    dump = tmp_path_factory.mktemp("pp_ref")
    run_layout(dump, parity_seed, nproc=1, dp=1, steps=STEPS, extra=VALIDATE)
    return _metrics(dump)


# Every schedule once; 1F1B with an explicit, uneven split (3 layers + 1) instead of 2 + 2.
_SCHEDULE_RUNS = [
    pytest.param(s, [SPLIT, "layers.3"] if s == "1F1B" else [], id=s) for s in SCHEDULES
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, split", _SCHEDULE_RUNS)
def test_pp2_schedule_parity(
    tmp_path: Path,
    parity_seed: Path,
    parity_reference: dict,
    pp_reference: dict,
    schedule: str,
    split: list[str],
) -> None:
    """PP 2 (4 microbatches; looped and V-shaped schedules hold 2 stages per rank) trains like
    one process: losses, clipped grad norm, and validation (forward-only through the stages)."""
    extra = [*PP2, SCHED, schedule, *split, *VALIDATE]
    run = train_layout(tmp_path, parity_seed, nproc=2, dp=1, steps=STEPS, extra=extra)
    # Ranks that silently skipped the split would train whole replicas and match just as well.
    lines = [ln.lower() for ln in run.output.splitlines() if "Pipeline: " in ln]
    assert len(lines) == 2 and all(f"pipeline: {schedule.lower()}," in ln for ln in lines), lines
    got = run.losses
    what = f"PP 2 {schedule} {' '.join(split)}"
    assert_parity(got, parity_reference, what=what)
    rows = _metrics(tmp_path)
    _assert_close(rows, pp_reference, "grad_norm", what)
    _assert_close(rows, pp_reference, "validation/loss", what)


@pytest.mark.multiprocess
def test_pp_fsdp_zero_bubble(
    tmp_path: Path, parity_seed: Path, parity_reference: dict, pp_reference: dict
) -> None:
    """PP x FSDP 2x2 with ZBVZeroBubble: FSDP must not reshard after forward under PP, or the
    deferred weight gradients come out wrong (measured 8e-4 relative at step 2)."""
    extra = [*PP2, SCHED, "ZBVZeroBubble"]
    got = run_layout(tmp_path, parity_seed, nproc=4, dp=2, steps=STEPS, extra=extra)
    assert_parity(got, parity_reference, what="PP x FSDP 2x2 ZBV")
    _assert_close(_metrics(tmp_path), pp_reference, "grad_norm", "PP x FSDP 2x2 ZBV")


@pytest.mark.multiprocess
def test_pp_fsdp_tp(
    tmp_path: Path, parity_seed: Path, parity_reference: dict, pp_reference: dict
) -> None:
    """3D PP x FSDP x TP 2x2x2 (8 processes), V-shaped zero-bubble schedule over TP stages."""
    extra = [*PP2, "--parallelism.tensor_parallel_degree", "2", SCHED, "ZBVZeroBubble"]
    got = run_layout(tmp_path, parity_seed, nproc=8, dp=2, steps=STEPS, extra=extra)
    assert_parity(got, parity_reference, what="PP x FSDP x TP 2x2x2")
    _assert_close(_metrics(tmp_path), pp_reference, "grad_norm", "PP x FSDP x TP 2x2x2")


@pytest.mark.multiprocess
def test_checkpoints_move_between_pp_and_one_process(tmp_path: Path, parity_seed: Path) -> None:
    """Full checkpoints keep the unsplit model's names: PP 2 (1F1B) saves step 2, one process
    resumes it and saves step 4, PP 2 (ZBV, other stage placement) resumes that; the losses
    continue an uninterrupted single-process run (DCP reshards model and optimizer state).
    The learning rate is constant after warmup so that it does not depend on training.steps."""
    flat_lr = ["--lr_scheduler.decay_ratio", "0"]
    save = ["--checkpoint.no_load_only", "--checkpoint.interval", "2"]
    save += ["--checkpoint.no_last_save_model_only", *flat_lr]
    ref = run_layout(tmp_path / "ref", parity_seed, nproc=1, dp=1, steps=6, extra=flat_lr)
    legs = [
        (2, [*PP2], 2),
        (1, [], 4),
        (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 6),
    ]
    previous: Path | None = None
    for i, (nproc, extra, steps) in enumerate(legs):
        dump = tmp_path / f"leg{i}"
        start = 1
        if previous is not None:
            start = steps - 1
            step_dir = f"step-{start - 1}"
            shutil.copytree(previous / "checkpoint" / step_dir, dump / "checkpoint" / step_dir)
        got = run_layout(
            dump, parity_seed, nproc=nproc, dp=1, steps=steps, start=start, extra=[*extra, *save]
        )
        assert_parity(got, ref, what=f"leg {i} ({nproc} processes)")
        previous = dump


def test_stage_split_and_names() -> None:
    """Split points give uneven stages; V-shaped schedules pair stage i with its mirror; the
    parts of all ranks together carry exactly the unsplit model's state-dict names."""
    cfg = parse_args([*MODEL, "--parallelism.pipeline_parallel_split_points", "layers.3"])
    plan = plan_pipeline(cfg, n_layers=4, tied_embeddings=False, pp=2)
    assert plan.module_names(0) == ["tok_embeddings", "layers.0", "layers.1", "layers.2"]
    assert plan.module_names(1) == ["layers.3", "norm", "output"]
    assert stage_ids_this_rank(0, 2, 4, "ZBVZeroBubble") == [0, 3]
    assert stage_ids_this_rank(0, 2, 4, "Interleaved1F1B") == [0, 2]

    cfg = parse_args([*MODEL, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    plan = plan_pipeline(cfg, n_layers=4, tied_embeddings=False, pp=2)
    args = get_flavor("llama3", "debugmodel_tiny")
    args.n_layers = 4
    with torch.device("meta"):
        whole = get_model_spec("llama3").model_cls(args)
    names = []
    for rank in range(2):
        parts = [
            split_module(whole, plan.module_names(s))
            for s in stage_ids_this_rank(rank, 2, plan.num_stages, plan.schedule)
        ]
        names += list(ModelPartsView(parts).state_dict())
    assert sorted(names) == sorted(whole.state_dict())


_BAD = [
    ([SCHED, "Zigzag"], "expected one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "),
    ([SPLIT, "layer.2"], "expected names layers.1 … layers.3, got 'layer.2'"),
    ([SPLIT, "layers.4"], "expected names layers.1 … layers.3, got 'layers.4'"),
    ([SPLIT, "layers.2", "layers.1"], "strictly increasing"),
    ([PER_STAGE, "3"], "divisor of the 4 layers"),
    ([SCHED, "LoopedBFS", "--model.n_layers", "3"], "needs 4 stages of at least one layer"),
    ([SCHED, "Interleaved1F1B", PER_STAGE, "2"], "needs a multiple of 2 stages with at least two"),
    ([PER_STAGE, "1"], "1F1B runs one stage per rank"),
    ([SCHED, "ZBVZeroBubble", SPLIT, "layers.2"], "two stages per rank (V shape)"),
    ([MB, "3"], "expected a divisor of training.local_batch_size (4), got 3"),
    ([SCHED, "DualPipeV", MB, "2"], "DualPipeV needs at least as many microbatches as stages"),
    ([MB, "4"], "1F1B needs at least as many microbatches as stages (2)"),
    ([SCHED, "Interleaved1F1B", "--training.local_batch_size", "5"], "multiple of its rounds"),
    (["--model.flavor", "debugmodel_tied"], "tied embedding/output table"),
    (
        [SCHED, "InterleavedZeroBubble", "--parallelism.fsdp_reshard_after_forward", "always"],
        "'always' gives wrong gradients",
    ),
    ([SCHED, "ZBVZeroBubble", "--compile.enable"], "disable compile.enable"),
    ([SCHED, "InterleavedZeroBubble", "--compile.enable"], "disable compile.enable"),
]


@pytest.mark.parametrize("extra, message", _BAD)
def test_bad_pipeline_configs_fail_before_any_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], message: str
) -> None:
    """Each mistake is one ConfigError line, raised by the trainer before it starts a process
    group (none could start here: no MASTER_ADDR) or writes anything."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    dump = tmp_path / "dump"
    argv = [*MODEL, *PP2, "--job.dump_folder", str(dump), "--training.local_batch_size", "4"]
    cfg = parse_args([*argv, *extra])
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    text = str(info.value)
    assert "\n" not in text and text.startswith("parallelism."), text
    assert message in text
    assert not dump.exists()


def test_pp_with_ddp_replication_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PP over replicated (non-sharded) data parallel is refused up front."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    argv = [*MODEL, *PP2, "--parallelism.data_parallel_replicate_degree", "2"]
    cfg = parse_args([*argv, "--parallelism.data_parallel_shard_degree", "1"])
    with pytest.raises(ConfigError, match=r"^parallelism\.data_parallel_replicate_degree: "):
        Trainer(cfg)
