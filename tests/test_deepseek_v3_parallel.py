"""DeepSeek-V3 under each parallelism: loss and gradient-norm parity of every layout against one
process from one seed checkpoint (tests/parallel_harness.py, the tiny DeepSeek-V3: MLA with a
query LoRA, qk 16 + 8 and v 16 channels per head, one dense then two MoE layers of 8 experts in
4 groups, one MTP block), and multi-token prediction refused in one line where it cannot run.

Multi-token prediction runs under FSDP, expert parallel (2 and 4), TP and CP (MTP on);
pipeline parallel runs with ``--model.mtp_layers 0`` against a single process with MTP off,
from the same seed (the MTP block's tensors in it are simply not loaded). fp32,
deterministic, tolerance 1e-5 relative. Each code path once (CI budget): FSDP 2 x EP 2 one
run, TP and PP one each, and one of 4 ranks for FSDP 2 x CP 2 x EP 4 (experts spread over
the data and context ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import titan_in_process
from parallel_harness import SEQ_LEN, assert_parity, make_seed_checkpoint, run_layout, train_layout

pytestmark = pytest.mark.multiprocess

MODEL = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel_tiny"]
NO_MTP = ["--model.mtp_layers", "0"]
STEPS = 3
P = "--parallelism."


def grad_norms(dump: Path) -> dict[int, float]:
    """Per-step gradient norms a run logged (more sensitive than the loss to a gradient that a
    layout leaves unreduced, such as the shared rotary key's under TP)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): r["grad_norm"] for r in rows if "grad_norm" in r}


@pytest.fixture(scope="module")
def dsv3_seed(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """The seed checkpoint of the tiny DeepSeek-V3 with its MTP block (every degree 1)."""
    return make_seed_checkpoint(tmp_path_factory.mktemp("dsv3_seed"), MODEL)


@pytest.fixture(scope="module")
def dsv3_reference(tmp_path_factory: pytest.TempPathFactory, dsv3_seed: Path) -> dict:
    """One process's (losses, grad norms), MTP on and off, keyed by ``mtp`` / ``no_mtp``."""
    out = {}
    for key, model in (("mtp", MODEL), ("no_mtp", [*MODEL, *NO_MTP])):
        dump = tmp_path_factory.mktemp(f"dsv3_ref_{key}")
        losses = run_layout(dump, dsv3_seed, nproc=1, dp=1, steps=STEPS, model=model)
        out[key] = (losses, grad_norms(dump))
    assert out["mtp"][0][1] == out["no_mtp"][0][1]  # step 1: the same forward
    assert out["mtp"][0][2] != out["no_mtp"][0][2]  # step 2 on: MTP's gradient has acted
    return out


@pytest.mark.parametrize(
    "name, nproc, dp, extra, mtp, applied",
    [
        # Dense parameters FSDP over 2 ranks, each rank 4 of the 8 experts, MTP block included.
        (
            "FSDP 2 x EP 2",
            2,
            2,
            [f"{P}expert_parallel_degree", "2"],
            True,
            "Applied FSDP on mesh {'dp_shard': 2}",
        ),
        (
            "TP 2",
            2,
            1,
            [f"{P}tensor_parallel_degree", "2"],
            True,
            "Applied tensor + sequence parallel (degree 2, loss parallel True)",
        ),
        (
            "PP 2",
            2,
            1,
            [f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", "1F1B"],
            False,
            "Pipeline: 1F1B, 2 stages on 2 ranks",
        ),
        (
            "FSDP 2 x CP 2 x EP 4",
            4,
            2,
            [f"{P}context_parallel_degree", "2", f"{P}expert_parallel_degree", "4"],
            True,
            f"ring attention over 2 ranks (allgather rotation), {SEQ_LEN // 2} of {SEQ_LEN}",
        ),
    ],
)
def test_deepseek_v3_layout_parity(
    tmp_path: Path,
    dsv3_seed: Path,
    dsv3_reference: dict,
    name: str,
    nproc: int,
    dp: int,
    extra: list[str],
    mtp: bool,
    applied: str,
) -> None:
    """Each layout logs that it applied itself and matches one process's losses and gradient
    norms (MLA's replicated down-projections and shared rotary key under TP, its qk/v head
    sizes in the CPU ring attention under CP)."""
    model = MODEL if mtp else [*MODEL, *NO_MTP]
    run = train_layout(
        tmp_path, dsv3_seed, nproc=nproc, dp=dp, extra=extra, steps=STEPS, model=model
    )
    assert applied in run.output, run.output[-4000:]
    losses, norms = dsv3_reference["mtp" if mtp else "no_mtp"]
    assert_parity(run.losses, losses, what=f"deepseek_v3 {name}")
    assert_parity(grad_norms(tmp_path), norms, what=f"deepseek_v3 {name} grad norm")


def test_mtp_with_pp_is_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MTP's modules need the first stage's embedding after the last stage: refused in one
    line, exit 2, before torchrun, naming the way out."""
    dump = tmp_path / "run"
    degree = "pipeline_parallel_degree"
    argv = ["train", "--ngpu", "2", *MODEL, f"{P}{degree}", "2", "--job.dump_folder", str(dump)]
    code, out, err = titan_in_process(argv, capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: parallelism.{degree}: 2 does not run multi-token prediction")
    assert "--model.mtp_layers 0" in err and not dump.exists()
