"""Qwen3-MoE under expert parallelism and every other parallelism: loss parity of each layout
against one process from one seed checkpoint (tests/parallel_harness.py, the tiny Qwen3-MoE:
8 experts, top-2, in all 4 layers), the experts really sharded, resume and activation
checkpointing bit for bit, and bad EP input refused before launch.

fp32, deterministic; tolerance 1e-5 relative except where stated. Every layout routes each
token exactly as the single process does (the router is replicated and sees the same tokens);
the aux loss counts tokens over the data x context ranks, so its gradient matches too.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import titan_in_process
from parallel_harness import (
    QWEN3_MOE_MODEL,
    LayoutRun,
    assert_parity,
    make_seed_checkpoint,
    run_layout,
    train_layout,
)

pytestmark = pytest.mark.multiprocess

STEPS = 4
NUM_EXPERTS = 8  # qwen3_moe_debugmodel_tiny
P = "--parallelism."
EP = f"{P}expert_parallel_degree"
PP2_ONE_MICROBATCH = [f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule"]
PP2_ONE_MICROBATCH += ["GPipe", f"{P}pipeline_parallel_microbatch_size", "2"]
SAVE = ["--checkpoint.no_load_only", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def moe_seed(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """The seed checkpoint of the tiny Qwen3-MoE (every degree 1)."""
    return make_seed_checkpoint(tmp_path_factory.mktemp("moe_seed"), QWEN3_MOE_MODEL)


def grad_norms(dump: Path) -> dict[int, float]:
    """Per-step gradient norms a run logged: more sensitive than the loss to a router or
    expert gradient that is off (e.g. a TP partial sum left unreduced)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): r["grad_norm"] for r in rows if "grad_norm" in r}


@pytest.fixture(scope="module")
def moe_reference_dump(tmp_path_factory: pytest.TempPathFactory, moe_seed: Path) -> Path:
    """The dump folder of one process's run from the seed checkpoint."""
    dump = tmp_path_factory.mktemp("moe_ref")
    run_layout(dump, moe_seed, nproc=1, dp=1, steps=STEPS, model=QWEN3_MOE_MODEL)
    return dump


@pytest.fixture(scope="module")
def moe_reference(moe_reference_dump: Path) -> dict:
    """The reference losses."""
    rows = [json.loads(line) for line in (moe_reference_dump / "metrics.jsonl").open()]
    return {int(r["step"]): r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def moe_reference_grad_norms(moe_reference_dump: Path) -> dict:
    """The reference gradient norms."""
    return grad_norms(moe_reference_dump)


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory: pytest.TempPathFactory, moe_seed: Path) -> tuple[Path, LayoutRun]:
    """EP 2 over 2 FSDP ranks, saving full states every 2 steps (for the resume test)."""
    dump = tmp_path_factory.mktemp("moe_ep2")
    run = train_layout(
        dump, moe_seed, nproc=2, dp=2, extra=[EP, "2", *SAVE], steps=STEPS, model=QWEN3_MOE_MODEL
    )
    return dump, run


_LAYOUT = re.compile(
    r"Expert parallel (\d+): ep rank (\d+), layers\.\d+\.experts\.w1 local \((\d+), (\d+), \d+\) "
    r"of \((\d+), (\d+), \d+\), placements (\{[^}]*\})"
)


def assert_experts_sharded(output: str, nproc: int, ep: int, efsdp: int, tp: int = 1) -> None:
    """Each rank logged its (pipeline stage's) first MoE layer's ``w1`` as read back from the
    parameter after parallelization: a DTensor sharded on the expert dim over ``ep`` (and the
    TP hidden shard), holding E / (ep x efsdp) experts, every ep rank present. A layout that
    replicated the experts (plain FSDP over all ranks, or no DTensor) logs another mesh and
    fails here."""
    rows = _LAYOUT.findall(output)
    assert len(rows) == nproc, output[-4000:]
    ranks = set()
    for degree, ep_rank, local_e, local_h, total_e, total_h, placements in rows:
        places = ast.literal_eval(placements)  # mesh dim -> placement
        assert int(degree) == ep and int(total_e) == NUM_EXPERTS
        assert places.get("ep") == "S(0)", placements
        assert places.get("tp") == ("S(1)" if tp > 1 else None), placements
        assert int(local_e) == NUM_EXPERTS // (ep * efsdp), rows
        assert int(local_h) * tp == int(total_h), rows
        ranks.add(int(ep_rank))
    assert ranks == set(range(ep))


def test_moe_ep2_parity_and_sharding(
    ep2_run: tuple[Path, LayoutRun], moe_reference: dict, moe_reference_grad_norms: dict
) -> None:
    """EP 2 (each of 2 ranks holds 4 of the 8 experts) trains like one process."""
    dump, run = ep2_run
    assert_experts_sharded(run.output, nproc=2, ep=2, efsdp=1)
    assert_parity(run.losses, moe_reference, what="moe EP 2")
    assert_parity(grad_norms(dump), moe_reference_grad_norms, what="moe EP 2 grad norm")


@pytest.mark.parametrize(
    "name, nproc, dp, extra, ep, efsdp, tp, applied",
    [
        # EP equal to the data ranks (experts not FSDP-sharded further): test_moe_ep2_parity_and
        # _sharding, and "EP 4 x CP 2" below.
        # 4 FSDP ranks, ep 2: each expert is FSDP-sharded over the other 2 (gradient divide
        # factor 4, as the dense layers').
        ("EP 2 x expert FSDP 2", 4, 4, [EP, "2"], 2, 2, 1, "Applied FSDP on mesh {'dp_shard': 4}"),
        (
            "EP 2 x TP 2",
            4,
            2,
            [EP, "2", f"{P}tensor_parallel_degree", "2"],
            2,
            1,
            2,
            "Applied tensor + sequence parallel (degree 2, loss parallel True)",
        ),
        # ep 4 takes both CP ranks and both FSDP ranks.
        (
            "EP 4 x CP 2",
            4,
            2,
            [EP, "4", f"{P}context_parallel_degree", "2"],
            4,
            1,
            1,
            "ring attention over 2 ranks",
        ),
        # One microbatch per step: the aux loss sees the same batch statistics as one process
        # (more microbatches: see test_moe_ep_pp_microbatches).
        (
            "EP 2 x PP 2",
            4,
            2,
            [EP, "2", *PP2_ONE_MICROBATCH],
            2,
            1,
            1,
            "Pipeline: GPipe",
        ),
    ],
)
def test_moe_ep_layout_parity(
    tmp_path: Path,
    moe_seed: Path,
    moe_reference: dict,
    moe_reference_grad_norms: dict,
    name: str,
    nproc: int,
    dp: int,
    extra: list[str],
    ep: int,
    efsdp: int,
    tp: int,
    applied: str,
) -> None:
    """Each EP layout applied itself, shards the experts as it should and matches one process."""
    run = train_layout(
        tmp_path, moe_seed, nproc=nproc, dp=dp, extra=extra, steps=STEPS, model=QWEN3_MOE_MODEL
    )
    assert applied in run.output, run.output[-4000:]
    assert_experts_sharded(run.output, nproc=nproc, ep=ep, efsdp=efsdp, tp=tp)
    assert_parity(run.losses, moe_reference, what=f"moe {name}")
    assert_parity(grad_norms(tmp_path), moe_reference_grad_norms, what=f"moe {name} grad norm")


def test_moe_tp_without_ep(
    tmp_path: Path, moe_seed: Path, moe_reference: dict, moe_reference_grad_norms: dict
) -> None:
    """TP 2 alone: experts hidden-sharded, router replicated, partial sums reduce-scattered.
    Without the routing weights' gradient sum over tp (``MoE.tp_group``) the step-1 gradient
    norm is off by 8e-5 and the step-4 loss by 9e-5 relative (measured)."""
    extra = [f"{P}tensor_parallel_degree", "2"]
    run = train_layout(
        tmp_path, moe_seed, nproc=2, dp=1, extra=extra, steps=STEPS, model=QWEN3_MOE_MODEL
    )
    assert "Applied tensor + sequence parallel (degree 2" in run.output
    assert_parity(run.losses, moe_reference, what="moe TP 2")
    assert_parity(grad_norms(tmp_path), moe_reference_grad_norms, what="moe TP 2 grad norm")


def test_moe_ep_pp_microbatches(tmp_path: Path, moe_seed: Path, moe_reference: dict) -> None:
    """EP 2 x PP 2 with 1F1B over 2 microbatches. The aux loss is defined per forward (as in
    HF with gradient accumulation): each microbatch's expert fractions and mean router
    probabilities are that microbatch's, so the router's aux gradient legitimately differs from
    one process's whole-batch one (the test above with one microbatch matches to 1e-7). The
    aux coefficient is 0.001: measured deviation 5.6e-6 relative by step 4; tolerance 3e-5."""
    extra = [EP, "2", f"{P}pipeline_parallel_degree", "2"]
    run = train_layout(
        tmp_path, moe_seed, nproc=4, dp=2, extra=extra, steps=STEPS, model=QWEN3_MOE_MODEL
    )
    assert "Pipeline: 1F1B" in run.output, run.output[-4000:]
    assert_parity(run.losses, moe_reference, rel=3e-5, what="moe EP 2 x PP 2 (2 microbatches)")


def test_moe_ep_resume_is_bitwise(tmp_path: Path, moe_seed: Path, ep2_run: tuple) -> None:
    """EP 2 resumed from its step-2 checkpoint trains steps 3-4 exactly as without a stop."""
    whole_dump, whole = ep2_run
    dump = tmp_path / "resumed"
    shutil.copytree(whole_dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    resumed = run_layout(
        dump, moe_seed, nproc=2, dp=2, extra=[EP, "2"], steps=STEPS, start=3, model=QWEN3_MOE_MODEL
    )
    assert resumed == {s: whole.losses[s] for s in range(3, STEPS + 1)}


def test_moe_ep_full_ac_equals_no_ac(tmp_path: Path, moe_seed: Path, ep2_run: tuple) -> None:
    """Full AC under EP: the recompute redoes the all-to-alls and the aux all-reduce on every
    rank alike and counts no token twice; the losses are the same bit for bit."""
    extra = [EP, "2", "--activation_checkpoint.mode", "full"]
    run = train_layout(
        tmp_path, moe_seed, nproc=2, dp=2, extra=extra, steps=STEPS, model=QWEN3_MOE_MODEL
    )
    assert "Activation checkpointing (full, every 1 block(s)) on 4/4 blocks" in run.output
    assert run.losses == ep2_run[1].losses


@pytest.mark.parametrize(
    "ngpu, argv, expected",
    [
        (
            2,
            [*QWEN3_MOE_MODEL, EP, "2", "--model.moe_num_experts", "3"],
            "error: parallelism.expert_parallel_degree: 2 must divide the number of experts (3)",
        ),
        (
            4,
            [*QWEN3_MOE_MODEL, EP, "4", f"{P}tensor_parallel_degree", "2"],
            "error: parallelism.expert_parallel_degree: 4 must divide data_parallel_shard_degree"
            " x context_parallel_degree = 2 x 1 = 2",
        ),
        (
            2,
            ["--module", "llama3", "--config", "llama3_debugmodel_tiny", EP, "2"],
            "error: parallelism.expert_parallel_degree: 2 needs a mixture-of-experts model",
        ),
        (
            2,
            [*QWEN3_MOE_MODEL, EP, "2", "--compile.enable"],
            "error: compile.enable: mixture-of-experts blocks do not compile as one graph yet",
        ),
    ],
    ids=["ep_not_dividing_experts", "ep_not_dividing_dp_shard_cp", "ep_without_moe", "compile"],
)
def test_bad_ep_is_one_line_before_launch(
    tmp_path: Path,
    ngpu: int,
    argv: list[str],
    expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`titan train --ngpu N` refuses in one line, exit 2, before torchrun or any output (in
    this process: test_entrypoints runs the same error path in a real one)."""
    dump = tmp_path / "run"
    argv = ["train", "--ngpu", str(ngpu), *argv, "--job.dump_folder", str(dump)]
    code, out, err = titan_in_process(argv, capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    assert err.count("\n") == 1 and err.startswith(expected), err
    assert "torchrun" not in out + err and not dump.exists()
