"""The Qwen3-MoE family against ``transformers``: logits both ways (dense layers in between,
norm_topk_prob on and off), per-expert HF tensors <-> stacked native ones through the CLI (both
dcp-to-hf paths), export + greedy generation, ``titan eval``, published parameter counts, the
grouped GEMM against the expert loop, deterministic routing, and refusals in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_helpers import (
    assert_bitwise,
    assert_export_generates_like_the_engine,
    assert_hf_to_dcp_refuses,
    convert_cli,
    dcp_model,
    hf_tensors,
    rel_diff,
)
from safetensors.torch import save_file

from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.cli import convert as cli
from titan_core.cli.evaluate import main as eval_main
from titan_core.convert import dcp_to_hf as dcp_to_hf_module
from titan_core.convert.dcp_to_hf import hf_config
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.errors import CheckpointError
from titan_core.models import describe_model, model_from_description
from titan_core.models.common.moe import MoE, MoEArgs, moe_layers
from titan_core.models.qwen3_moe import Qwen3MoeModel, Qwen3MoeModelArgs, qwen3_moe_flavors
from titan_core.models.qwen3_moe.state_dict_adapter import (
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)
from titan_core.resolve import parse_args
from titan_core.train import main as train_main
from titan_core.train import run

transformers = pytest.importorskip("transformers")

TINY = ["--module", "qwen3_moe", "--config", "qwen3_moe_debugmodel_tiny"]
# Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json: (hidden, layers, heads,
# intermediate, moe_intermediate), 4 kv heads of 128, 128 experts top-8, vocabulary 151936;
# then the published (total, activated) parameter counts.
PUBLISHED = {
    "30B-A3B": ((2048, 48, 32, 6144, 768), (30_532_122_624, 3_353_032_704)),
    "235B-A22B": ((4096, 94, 64, 12288, 1536), (235_093_634_560, 22_190_763_520)),
}


# ---------------------------------------------------------------- helpers
def _tiny_args(
    norm: bool = True, vocab: int = 256, n_layers: int = 4, **overrides: Any
) -> Qwen3MoeModelArgs:
    """The tiny flavor (head_dim 32 != 64 / 4 heads, GQA 4/2, 8 experts top-2), by default
    with a dense layer before each MoE one (HF decoder_sparse_step 2)."""
    args = qwen3_moe_flavors["debugmodel_tiny"]
    moe = dataclasses.replace(args.moe, route_norm=norm)
    fields = dict(vocab_size=vocab, max_seq_len=128, n_layers=n_layers, decoder_sparse_step=2)
    return dataclasses.replace(args, moe=moe, **{**fields, **overrides})


def _randomize(model: torch.nn.Module) -> None:
    """Norm scales around 1 and O(1) router weights: the QK-norm permutation and the expert
    choice (a router at init sends every token almost uniformly) both matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "router.gate.weight")):
                p.normal_(0.0, 0.5)


def _hf_model(args: Qwen3MoeModelArgs) -> Any:
    """A randomly initialized ``Qwen3MoeForCausalLM`` of ``args``' shape, from the adapter's
    config."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig.from_dict(to_hf_config(args))
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    _randomize(model)
    return model


# ---------------------------------------------------------------- logits parity
@pytest.mark.parametrize(
    ("norm", "layout"),
    [(True, {}), (False, {"n_layers": 3, "decoder_sparse_step": 1, "mlp_only_layers": (1,)})],
    ids=["norm_topk-sparse_step_2", "no_norm-mlp_only_layers"],
)
def test_logits_match_transformers_both_ways(
    norm: bool, layout: dict[str, Any], tmp_path: Path
) -> None:
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    # HF -> engine: config.json read back through the adapter, transformers' in-memory (fused)
    # expert tensors stacked by from_hf, strict load.
    hf = _hf_model(_tiny_args(norm, **layout))
    args = from_hf_config(hf.config.to_dict(), "config.json")
    assert args == _tiny_args(norm, **layout)
    assert args.head_dim * args.n_heads != args.dim and args.moe.route_norm is norm
    ours = Qwen3MoeModel(args).eval()
    assert 0 < len(moe_layers(ours)) < args.n_layers  # dense layers in between
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    with torch.no_grad():
        assert rel_diff(ours(tokens), hf(tokens).logits) <= 1e-5

    # Engine -> HF: the engine's own init, exported per expert to a folder that
    # transformers loads (and fuses) itself, nothing missing or unexpected.
    torch.manual_seed(2)
    ours = Qwen3MoeModel(args).eval()
    ours.init_weights()
    _randomize(ours)
    folder = tmp_path / "hf"
    folder.mkdir()
    exported = to_hf(ours.state_dict(), args)
    moe, dense = (min(i for i in range(args.n_layers) if args.moe_layer(i) == m) for m in (1, 0))
    assert f"model.layers.{moe}.mlp.experts.7.down_proj.weight" in exported
    assert f"model.layers.{dense}.mlp.gate_proj.weight" in exported  # dense: Qwen3's names
    save_file(exported, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_config(args, "float32", None, None)))
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        folder, local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert rel_diff(ours(tokens), hf.eval()(tokens).logits) <= 1e-5


def test_partial_state_dicts_convert_key_by_key() -> None:
    """dcp-to-hf converts one native tensor at a time: a stacked expert weight gives its E
    expert tensors; from_hf needs a layer's experts together (one line naming the first
    missing)."""
    args = _tiny_args()
    w1 = torch.randn(8, 32, 64)
    out = to_hf({"layers.1.moe.experts.w1": w1}, args)
    assert list(out) == [f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(8)]
    assert all(torch.equal(out[k], w1[e]) for e, k in enumerate(out))
    assert torch.equal(from_hf(out, args)["layers.1.moe.experts.w1"], w1)
    gate = {"model.layers.3.mlp.gate.weight": torch.randn(8, 64)}
    assert list(from_hf(gate, args)) == ["layers.3.moe.router.gate.weight"]
    del out["model.layers.1.mlp.experts.5.gate_proj.weight"]
    with pytest.raises(CheckpointError, match=r"^from_hf: layers\.1\.moe\.experts\.w1: expert 5 "):
        from_hf(out, args)


@pytest.mark.parametrize("flavor", [f for f in qwen3_moe_flavors if f != "debugmodel_shared"])
def test_hf_config_gives_back_the_model_args(flavor: str) -> None:
    args = qwen3_moe_flavors[flavor]
    config = json.loads(json.dumps(hf_config(args, "bfloat16", None, "qwen3_moe")))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe" and config["output_router_logits"] is False
    assert from_hf_config(config, "config.json") == args
    # transformers' own config object reads every key (num_experts is its alias there).
    hf = transformers.Qwen3MoeConfig.from_dict(config)
    assert (hf.num_experts, hf.num_experts_per_tok) == (args.moe.num_experts, args.moe.top_k)
    assert from_hf_config(hf.to_dict(), "config.json") == args


def test_checkpoint_description_round_trips_every_flavor() -> None:
    """The commit marker's model description rebuilds the nested MoEArgs and the
    mlp_only_layers tuple (dcp-to-hf, eval and train read it)."""
    for flavor, args in qwen3_moe_flavors.items():
        args = dataclasses.replace(args, mlp_only_layers=(0, 3))
        described = json.loads(json.dumps(describe_model("qwen3_moe", args)))
        assert model_from_description(described, "m") == ("qwen3_moe", args), flavor


# ---------------------------------------------------------------- conversion through the CLI
@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Any]:
    """A transformers-written Qwen3-MoE folder (per-expert tensors) and the DCP checkpoint
    ``titan convert hf-to-dcp`` makes of it (no config anywhere near)."""
    root = tmp_path_factory.mktemp("qwen3_moe_imported")
    vocab = Tokenizer(str(default_tokenizer_path())).n_words
    args = _tiny_args(vocab=vocab, max_seq_len=2048)
    _hf_model(args).save_pretrained(root / "hf")  # fp32, one model.safetensors
    assert cli.main(["hf-to-dcp", "--hf", str(root / "hf"), "--output", str(root / "dcp")]) == 0
    return {"args": args, "hf": root / "hf", "dcp": root / "dcp"}


def test_hf_to_dcp_to_hf_is_bitwise(
    imported: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """HF -> DCP -> HF, every tensor equal bit for bit, through the streaming path (expert
    tensors copied straight out of the stacked ones) and the in-memory one (remote
    checkpoints)."""
    original = hf_tensors(imported["hf"])
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in original
    dcp_dir = str(imported["dcp"])
    native = dcp_model(imported["dcp"])
    assert native["layers.1.moe.experts.w2"].shape == (8, 64, 32)
    planned = {
        t.name: t for t in dcp_to_hf_module.read_checkpoint_tensors(dcp_dir, imported["args"])
    }
    experts = planned["layers.3.moe.experts.w3"]
    assert [name for name, _ in experts.parts][-1] == "model.layers.3.mlp.experts.7.up_proj.weight"
    assert dcp_to_hf_module.row_order(experts, imported["args"]) is None  # streamed as stored
    argv = ["dcp-to-hf", "--checkpoint", dcp_dir, "--dtype", "fp32", "--no-progress"]
    rc, err = convert_cli([*argv, "--output", str(tmp_path / "direct")], capsys)
    assert rc == 0, err
    assert_bitwise(original, hf_tensors(tmp_path / "direct"))
    config = json.loads((tmp_path / "direct" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert from_hf_config(config, "config.json") == imported["args"]

    monkeypatch.setattr(dcp_to_hf_module, "locate_direct", lambda *a, **k: {})
    rc, err = convert_cli([*argv, "--output", str(tmp_path / "in_memory")], capsys)
    assert rc == 0, err
    assert_bitwise(original, hf_tensors(tmp_path / "in_memory"))


def test_eval_reads_a_qwen3_moe_checkpoint(imported: dict[str, Any], tmp_path: Path) -> None:
    argv = ["--checkpoint", str(imported["dcp"]), "--output", str(tmp_path), "--max-batches", "1"]
    assert eval_main([*argv, "--prompts", "--validation.local_batch_size", "2"]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["model"]["name"] == "qwen3_moe"
    assert report["model"]["vocab_size"] == imported["args"].vocab_size


def test_trained_checkpoint_exports_and_generates_like_the_engine(
    tmp_path: Path, assets: Path
) -> None:
    """2 engine training steps -> dcp-to-hf -> AutoModelForCausalLM (which fuses the
    per-expert tensors itself): same logits, same greedy tokens."""
    flavor = qwen3_moe_flavors["debugmodel_tiny"]
    assert_export_generates_like_the_engine(
        tmp_path, TINY, Qwen3MoeModel, flavor, "Qwen3MoeForCausalLM"
    )


# ---------------------------------------------------------------- published shapes
def test_published_parameter_counts_match_transformers() -> None:
    for flavor, ((hidden, layers, heads, intermediate, moe), counts) in PUBLISHED.items():
        config = transformers.Qwen3MoeConfig(
            vocab_size=151936,
            hidden_size=hidden,
            intermediate_size=intermediate,
            moe_intermediate_size=moe,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            max_position_embeddings=40960,
        )
        with torch.device("meta"):
            hf = transformers.Qwen3MoeForCausalLM(config)
        args = qwen3_moe_flavors[flavor]
        assert args.param_counts() == counts, flavor
        assert args.num_params() == sum(p.numel() for p in hf.parameters()), flavor
        assert from_hf_config(config.to_dict(), "config.json") == dataclasses.replace(
            args, max_seq_len=40960
        )


# ---------------------------------------------------------------- experts
def test_grouped_gemm_and_loop_agree() -> None:
    """fp32 on CPU: outputs and every gradient (input, router, experts) of the grouped GEMM
    path equal the per-expert loop's, with an expert that gets no token."""
    torch.manual_seed(0)
    moe = MoE(64, MoEArgs(num_experts=8, top_k=2, hidden_dim=32))
    moe.init_weights(0.02)
    x = torch.randn(1, 3, 64)
    results = []
    for grouped in (False, True):
        moe.zero_grad()
        moe.experts.grouped_mm = grouped
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
        results.append((out.detach(), xi.grad, grads))
    assert (moe.tokens_per_expert == 0).any()  # an empty group on both paths
    (out0, gx0, g0), (out1, gx1, g1) = results
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)


def test_routing_is_deterministic(tmp_path: Path, assets: Path) -> None:
    """Identical forwards route identically (same per-expert counts in every layer), and two
    ``--debug.deterministic`` runs log identical losses and expert loads."""
    args = _tiny_args(n_layers=2, decoder_sparse_step=1)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    counts = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Qwen3MoeModel(args)
        model.init_weights()
        model(tokens).sum().backward()
        counts.append({k: m.tokens_per_expert.clone() for k, m in moe_layers(model).items()})
    assert sorted(counts[0]) == ["layers.0", "layers.1"]
    for k in counts[0]:
        assert counts[0][k].sum() == 2 * 32 * 2 and torch.equal(counts[0][k], counts[1][k])

    argv = [*TINY, "--training.steps", "3", "--metrics.log_freq", "1", "--validation.no_enable"]
    argv += ["--debug.deterministic", "--checkpoint.no_enable"]
    logged = [run(parse_args([*argv, "--job.dump_folder", str(tmp_path / d)])) for d in "ab"]
    keys = [k for k in logged[0][0] if k == "loss" or k.startswith("moe/")]
    assert "moe/layer1/load_max" in keys
    for a, b in zip(*logged, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


# ---------------------------------------------------------------- refusals
def test_top_k_above_the_experts_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = tmp_path / "run"
    assert train_main([*TINY, "--model.moe_top_k", "9", "--job.dump_folder", str(dump)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.moe_top_k: 9 ") and "\n" not in err, err
    assert "8 experts" in err
    assert not dump.exists()


def test_moe_overrides_reach_the_model_args() -> None:
    """``model.moe_*`` change the flavor's MoE args; on a dense family they are one line."""
    from titan_core.build import flavor_args
    from titan_core.errors import ConfigError

    overrides = ["--model.moe_num_experts", "4", "--model.moe_top_k", "3"]
    overrides += ["--model.moe_aux_loss_coef", "0", "--model.moe_load_balance_bias", "on"]
    moe = flavor_args(parse_args([*TINY, *overrides])).moe
    assert (moe.num_experts, moe.top_k, moe.aux_loss_coef, moe.load_balance_bias) == (
        4,
        3,
        0.0,
        True,
    )
    kept = flavor_args(parse_args(TINY)).moe
    assert (kept.num_experts, kept.top_k, kept.aux_loss_coef, kept.load_balance_bias) == (
        8,
        2,
        0.001,
        False,
    )
    dense = ["--module", "qwen3", "--config", "qwen3_debugmodel_tiny"]
    refused = r"model\.moe_aux_loss_coef: qwen3 debugmodel_tiny has no"
    with pytest.raises(ConfigError, match=refused):
        flavor_args(parse_args([*dense, "--model.moe_aux_loss_coef", "0.01"]))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be between 1 and num_experts"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"moe_intermediate_size": None}, "lacks moe_intermediate_size"),
    ],
    ids=["top_k", "sliding_window", "bias", "gelu", "no_moe_size"],
)
def test_hf_to_dcp_refuses_what_it_cannot_read(
    config: dict[str, Any], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_hf_to_dcp_refuses(to_hf_config(_tiny_args()), config, expected, tmp_path, capsys)


def test_routing_qwen3_moe_cannot_hold_is_refused() -> None:
    """Shared experts, sigmoid scores and the loss-free bias (debugmodel_shared) have no
    Qwen3MoeForCausalLM form: config and tensors are refused in one line naming them."""
    args = qwen3_moe_flavors["debugmodel_shared"]
    expected = (
        r"Qwen3MoeForCausalLM cannot represent 1 shared expert\(s\), sigmoid router scores, "
        r"the loss-free load-balance bias"
    )
    with pytest.raises(CheckpointError, match=rf"^to_hf_config: {expected}"):
        to_hf_config(args)
    with pytest.raises(CheckpointError, match=rf"^to_hf: {expected}"):
        to_hf({"layers.0.moe.router.gate.weight": torch.zeros(8, 256)}, args)


# ---------------------------------------------------------------- expert parallel
@pytest.mark.multiprocess
def test_expert_parallel_checkpoint_exports_like_one_process(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of 2 ranks with EP 2 (each rank saved half of every layer's experts)
    exports the same bytes whether streamed from the ranks' files or resharded by DCP, in
    both dtypes."""
    import os
    import subprocess
    import sys

    dump = tmp_path / "ep"
    argv = [*TINY, "--training.steps", "2", "--checkpoint.interval", "2"]
    argv += ["--validation.no_enable", "--parallelism.expert_parallel_degree", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "titan_core.train", *argv, "--job.dump_folder", str(dump)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = dump / "checkpoint" / "step-2"
    chunks = dcp_reader(str(step)).read_metadata().state_dict_metadata
    assert [c.sizes[0] for c in chunks["model.layers.1.moe.experts.w2"].chunks] == [4, 4]
    for dtype in ("fp32", "bf16"):
        argv = ["dcp-to-hf", "--checkpoint", str(step), "--dtype", dtype, "--no-progress"]
        assert cli.main([*argv, "--output", str(tmp_path / f"direct_{dtype}")]) == 0
        with monkeypatch.context() as patch:
            patch.setattr(dcp_to_hf_module, "locate_direct", lambda *a, **k: {})
            assert cli.main([*argv, "--output", str(tmp_path / f"dcp_{dtype}")]) == 0
        direct = hf_tensors(tmp_path / f"direct_{dtype}")
        assert_bitwise(direct, hf_tensors(tmp_path / f"dcp_{dtype}"))
    native = dcp_model(step)["layers.1.moe.experts.w2"]
    assert torch.equal(
        direct["model.layers.1.mlp.experts.6.down_proj.weight"], native[6].bfloat16()
    )
