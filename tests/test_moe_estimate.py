"""``titan estimate`` and the COMM_MODE dry run for mixture-of-experts models: total and
activated parameters, experts sharded over ep x expert-FSDP, all-to-all buffers, and the real
expert-parallel code on fake process groups holding what the estimate predicts."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from titan_core import comm_mode
from titan_core.cli import estimate as cli
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.errors import ConfigError
from titan_core.estimate.fake_moe import even_splits
from titan_core.estimate.layout import build_layout, rank_param_shapes
from titan_core.models import get_flavor
from titan_core.resolve import parse_args
from titan_core.train import run

ROOT = Path(__file__).resolve().parents[1]
P = "--parallelism."
MOE_30B = ["--module", "qwen3_moe", "--config", "qwen3_moe_30b_a3b"]
DEBUG = ["--module", "qwen3_moe", "--config", "qwen3_moe_debugmodel"]
TP2_EP2 = [f"{P}tensor_parallel_degree", "2", f"{P}expert_parallel_degree", "2"]


def test_30b_a3b_on_64_ranks_with_ep_8(capsys: pytest.CaptureFixture) -> None:
    """The published counts exactly; 16 experts per ep rank, FSDP-sharded over the 8 ranks
    left; every rank holds 1/64 of all parameters (the 30B's dims divide by 64)."""
    assert cli.main(["--ngpu", "64", *MOE_30B]) == 0
    text = capsys.readouterr().out
    assert "30,532,122,624 parameters (3,353,032,704 activated)" in text
    assert "world 64 = dp_replicate 1 × dp_shard 64 × cp 1 × tp 1 × pp 1; ep 8" in text
    assert "16 experts per rank, FSDP-sharded over 8" in text
    assert "expert-parallel all-to-all buffers" in text

    assert cli.main(["--ngpu", "64", *MOE_30B, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["num_params"] == 30_532_122_624
    assert out["model"]["num_activated_params"] == 3_353_032_704
    assert out["degrees"]["ep"] == 8 and out["degrees"]["dp_shard"] == 64
    moe, mem = out["moe"], out["memory"]
    flavor = get_flavor("qwen3_moe", "30B-A3B")
    assert moe["num_experts"] == 128 and moe["top_k"] == 8 and moe["moe_layers"] == 48
    tokens = out["batch"]["microbatch_size"] * out["batch"]["seq_len"]
    assert moe["routed_rows_per_layer"] == tokens * 8
    # dispatch + combine, each a send and a receive buffer of rows x dim in bf16
    assert moe["all_to_all_bytes_per_layer"] == 4 * tokens * 8 * flavor.dim * 2
    assert mem["all_to_all"] == moe["all_to_all_bytes_per_layer"]
    # fp32 master weights: dense dims 0 divide by 64, experts 128 / ep 8 / efsdp 8 = 2 each
    assert mem["params"] == out["model"]["num_params"] * 4 // 64
    assert mem["optimizer"] > 2 * mem["params"]
    # FLOPs count activated parameters only: 6 x (activated - embedding) + attention
    activated = 3_353_032_704 - flavor.vocab_size * flavor.dim
    seq = out["batch"]["seq_len"]
    attention = 12 * flavor.n_layers * flavor.n_heads * flavor.head_dim * seq
    assert out["flops"]["flops_per_token"] == 6 * activated + attention


def test_235b_a22b_counts_and_expert_shards() -> None:
    """The 235B recipe (TP 4, EP 8) at 64 ranks: published counts; each rank's experts are
    the ep-local 16, TP-sharded on the hidden dim, FSDP over dp_shard / (ep / cp) = 2."""
    layout = build_layout(
        parse_args(["--module", "qwen3_moe", "--config", "qwen3_moe_235b_a22b"]), 64
    )
    assert (layout.num_params, layout.num_activated_params) == (235_093_634_560, 22_190_763_520)
    assert (layout.dims.tp, layout.dims.ep, layout.expert_shard_degree) == (4, 8, 2)
    flavor = get_flavor("qwen3_moe", "235B-A22B")
    hidden, dim = flavor.moe.hidden_dim, flavor.dim
    assert layout.tp_shard_dims["layers.0.moe.experts.w1"] == 1
    assert layout.tp_shard_dims["layers.0.moe.experts.w2"] == 2
    assert layout.param_shard_degree("layers.0.moe.experts.w2") == 2
    assert layout.param_shard_degree("layers.0.attention.wq.weight") == 16
    shapes = rank_param_shapes(layout, layout.ranks[0])
    assert shapes["layers.0.moe.experts.w1"] == (16, hidden // 4, dim)
    assert shapes["layers.0.moe.experts.w2"] == (16, dim, hidden // 4)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            [
                "--module",
                "qwen3_moe",
                "--config",
                "qwen3_moe_debugmodel",
                f"{P}expert_parallel_degree",
                "16",
            ],
            16,
            r"^parallelism\.expert_parallel_degree: 16 must divide the number of",
        ),
        (
            [
                "--module",
                "qwen3",
                "--config",
                "qwen3_debugmodel",
                f"{P}expert_parallel_degree",
                "2",
            ],
            2,
            r"^parallelism\.expert_parallel_degree: 2 needs a mixture-of-experts model",
        ),
    ],
    ids=["ep_does_not_divide_experts", "ep_on_a_dense_model"],
)
def test_bad_expert_parallel_is_one_line(
    argv: list[str], world: int, message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_layout(parse_args(argv), world)
    assert cli.main(["--ngpu", str(world), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: parallelism.expert_parallel_degree") and "\n" not in err


def test_even_splits() -> None:
    assert even_splits(10, 4) == [3, 3, 2, 2] and sum(even_splits(7, 7)) == 7


@pytest.mark.parametrize(
    "argv, world, ep_local, efsdp",
    [
        # The published 30B-A3B's shapes (2 of its 48 layers, seq 512: CI budget) at 64 ranks,
        # EP 8 x expert-FSDP 8 inside FSDP 64.
        ([*MOE_30B, "--model.n_layers", "2", "--training.seq_len", "512"], 64, 16, 8),
        # EP 2 with TP 2 (experts (Shard(0), Shard(1|2)) on (ep, tp)) on the debug model.
        (
            [*DEBUG, "--model.n_layers", "2", *TP2_EP2],
            8,
            4,
            2,
        ),
    ],
    ids=["30b_a3b_shapes_64_ranks_ep8", "debug_ep2_x_tp2_x_fsdp4"],
)
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_moe_fake_backend_dry_run(
    tmp_path: Path, assets: Path, argv: list[str], world: int, ep_local: int, efsdp: int
) -> None:
    """COMM_MODE=fake_backend in one process: the experts are DTensors sharded over ep (each
    rank holds only its experts) and FSDP-sharded over the rest; one step through the real
    all-to-all on balanced routing; rank 0's bytes equal the estimate's."""
    args = [*argv, "--comm.mode", "fake_backend", "--comm.fake_world_size", str(world)]
    report = comm_mode.dry_run(parse_args([*args, "--job.dump_folder", str(tmp_path)]))
    ep = parse_args(argv).parallelism.expert_parallel_degree
    assert f"; ep {ep} (carved from dp_shard × cp)" in report.mesh[0]
    assert f"ep={ep}" in report.mesh[1]  # the flattened (dp_shard_in_ep, cp) view
    rows = {row.name.split("] ")[-1]: row for row in report.modules}
    experts = next(r for n, r in rows.items() if n.endswith("moe.experts"))
    assert "FSDP unit" in experts.applied and "S(0)@ep" in experts.params
    assert "@dp_shard_mod_ep" in experts.params
    local = math.ceil(ep_local / efsdp)
    assert f"→ [{local}," in experts.params
    step, expected = report.step, comm_mode.rank0_estimate(report.estimate)
    assert step.num_params > 0 and step.params_with_grad == step.num_params
    assert step.param_bytes == expected.params
    assert step.grad_bytes == expected.grads
    assert step.optimizer_bytes == expected.optimizer
    assert report.peak_rss_bytes < 2 * 2**30


def _doc_commands(tool: str) -> list[list[str]]:
    """``titan <tool>`` commands of docs/moe.md (one process only), as argv after the tool."""
    text = (ROOT / "docs" / "moe.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("  #")[0])
            if words[:2] == ["titan", tool] and (tool == "estimate" or "--ngpu" not in words):
                found.append(words[2:])
    return found


def test_moe_doc_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """docs/moe.md: its estimates print what the page shows; its one-process training command
    trains and logs the load metrics; its dry run holds what the estimate predicts."""
    estimates = _doc_commands("estimate")
    assert len(estimates) >= 2
    for argv in estimates:
        assert cli.main(argv) == 0, argv
    out = capsys.readouterr().out
    shown = (ROOT / "docs" / "moe.md").read_text()
    header = next(line for line in out.splitlines() if line.startswith("qwen3_moe 30B-A3B"))
    assert header in shown
    trains = _doc_commands("train")
    assert len(trains) == 2, trains  # the tiny CPU run and the fake_backend dry run
    for argv in trains:
        cfg = parse_args([*argv, "--job.dump_folder", str(tmp_path / "out")])
        if cfg.comm.mode == "fake_backend":
            report = comm_mode.dry_run(cfg)
            assert report.step.param_bytes == comm_mode.rank0_estimate(report.estimate).params
        else:
            history = run(cfg)
            assert [h["step"] for h in history if "moe/load_max" in h] == [1, 5, 10]


@pytest.mark.parametrize(
    ("dp_shard", "cp", "ep", "message"),
    [
        (4, 2, 3, "3 must be a multiple of context_parallel_degree (2)"),
        (2, 2, 8, "8 must divide data_parallel_shard_degree x context_parallel_degree"),
        (4, 1, 0, "expected an int >= 1, got 0"),
    ],
    ids=["not_a_multiple_of_cp", "more_than_dp_shard_x_cp", "zero"],
)
def test_expert_parallel_rule(dp_shard: int, cp: int, ep: int, message: str) -> None:
    """``ep`` takes every CP rank and part of the FSDP ranks; anything else is one line."""
    with pytest.raises(
        ConfigError, match=re.escape(f"parallelism.expert_parallel_degree: {message}")
    ):
        ParallelDims(
            dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, world_size=dp_shard * cp, ep=ep
        )


@pytest.mark.parametrize(
    ("dp_shard", "cp", "ep", "in_ep", "mod_ep"),
    [(8, 1, 8, 8, 1), (8, 1, 2, 2, 4), (4, 2, 2, 1, 4), (4, 2, 4, 2, 2)],
)
def test_expert_parallel_carves_dp_shard(
    dp_shard: int, cp: int, ep: int, in_ep: int, mod_ep: int
) -> None:
    """ep = dp_shard_in_ep x cp; what is left of dp_shard FSDP-shards each expert."""
    dims = ParallelDims(
        dp_replicate=2, dp_shard=dp_shard, cp=cp, tp=2, pp=1, world_size=4 * dp_shard * cp, ep=ep
    )
    assert (dims.dp_shard_in_ep, dims.dp_shard_mod_ep) == (in_ep, mod_ep)
    assert dims.dp_shard_in_ep * cp == ep and in_ep * mod_ep == dp_shard
    assert dims.expert_fsdp_mesh_dims == ("dp_replicate", "dp_shard_mod_ep")
