"""DeepSeek-V3 in ``titan estimate`` and the MFU formula: the recipes' published parameter
counts exactly (multi-token prediction shown apart), and the FLOPs per token the trainer
reports MFU with equal to what ``FlopCounterMode`` counts over a real forward and backward of
the tiny model (MLA's low-rank projections and its qk/v head sizes, top-k routed and shared
experts, the MTP block and its second pass through the shared output head)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titan_core import comm_mode
from titan_core.estimate.layout import build_layout
from titan_core.models.deepseek_v3 import DeepseekV3Model, deepseek_v3_flavors
from titan_core.resolve import parse_args

PUBLISHED = {  # recipe: (total, activated) as the model cards count them (no MTP module)
    "deepseek_v3_16b_a3b": (15_960_108_544, 2_914_774_528),
    "deepseek_v3_671b_a37b": (671_026_404_352, 37_552_282_624),
    "deepseek_v3_1t_a32b": (1_026_408_209_408, 32_861_477_888),
}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_recipes_give_the_published_counts(recipe: str) -> None:
    """The layout's counts are the cards'; DeepSeek-V3's MTP module adds one MoE layer (its
    attention, 256 experts, a shared expert), its input norms and projection and head norm:
    11,610,067,968 parameters, of which 688,100,352 per token (the HF release's 685B also
    holds copies of the embedding and output head in that layer)."""
    layout = build_layout(parse_args(["--module", "deepseek_v3", "--config", recipe]), 256)
    assert (layout.num_params, layout.num_activated_params) == PUBLISHED[recipe]
    held = sum(p.numel() for p in layout.model.parameters())
    assert layout.num_params + layout.num_mtp_params == held
    if recipe == "deepseek_v3_671b_a37b":
        assert (layout.num_mtp_params, layout.num_mtp_activated_params) == (
            11_610_067_968,
            688_100_352,
        )
    else:  # Moonlight and Kimi K2 ship no MTP layer
        assert (layout.num_mtp_params, layout.num_mtp_activated_params) == (0, 0)


def _counted(model: DeepseekV3Model, tokens: torch.Tensor) -> int:
    """Matmul and attention FLOPs of one training forward + backward (every linear's input
    gradient included: the embedding output requires grad)."""
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
    return counter.get_total_flops()


def _norm_params(model: torch.nn.Module) -> int:
    """RMSNorm scales: parameters the formula counts at 6 FLOPs per token, no matmul's."""
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))


def test_flops_per_token_match_the_counted_graph() -> None:
    """MTP off and on: the formula times the tokens is the count exactly (less the norm
    scales); the MTP depth runs over the whole window (its last target ignored), so it costs
    what one more layer and one more output head do."""
    bs, seq = 2, 32
    args = dataclasses.replace(
        deepseek_v3_flavors["debugmodel_tiny"], vocab_size=256, max_seq_len=seq
    )
    tokens = torch.randint(0, 256, (bs, seq), generator=torch.Generator().manual_seed(0))
    counts, formula = {}, {}
    for mtp in (0, 1):
        torch.manual_seed(0)
        model_args = dataclasses.replace(args, mtp_layers=mtp)
        model = DeepseekV3Model(model_args)
        model.init_weights()
        model.train()
        counts[mtp] = _counted(model, tokens)
        _, per_token = model_args.get_nparams_and_flops(model, seq)
        formula[mtp] = (per_token, _norm_params(model))
    for mtp in (0, 1):
        per_token, norms = formula[mtp]
        assert counts[mtp] == (per_token - 6 * norms) * bs * seq, mtp
    assert counts[1] > counts[0]


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_671b_recipe_dry_run_at_256_ranks(tmp_path: Path) -> None:
    """COMM_MODE=fake_backend of the 671B recipe (EP 64 x FSDP 256) in one process, with 4 of
    its 61 layers (3 dense, 1 MoE) plus the MTP block (MoE) and 512 tokens (CI budget; all 61
    layers at 4096 tokens: see docs/models.md): every parameter gets a gradient and rank 0
    holds exactly the bytes the estimate predicts, the MTP block's included."""
    args = ["--module", "deepseek_v3", "--config", "deepseek_v3_671b_a37b", "--model.n_layers"]
    args += ["4", "--training.seq_len", "512", "--comm.mode", "fake_backend"]
    args += ["--comm.fake_world_size", "256", "--job.dump_folder", str(tmp_path)]
    report = comm_mode.dry_run(parse_args(args))
    step, expected = report.step, comm_mode.rank0_estimate(report.estimate)
    assert step.num_params > 0 and step.params_with_grad == step.num_params
    assert any(row.name.endswith("layers.{4}.mtp_input.eh_proj") for row in report.modules)
    assert step.param_bytes == expected.params
    assert step.grad_bytes == expected.grads
    assert step.optimizer_bytes == expected.optimizer
