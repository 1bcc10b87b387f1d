"""The DeepSeek-V3 family against ``transformers``: logits both ways (query LoRA on and off,
interleaved and rotate-half RoPE layouts, YaRN with its softmax correction, group-limited
routing that does exclude groups), HF -> DCP -> HF bit for bit through the CLI (with and
without the MTP layer), FP8 block-scaled checkpoints read as their dequantized original,
published parameter counts, multi-token prediction's loss and gradient, a trained export
generating like the engine, and refusals in one line."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
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
from safetensors.torch import load_file, save_file

from titan_core.cli.convert import main as convert_main
from titan_core.convert import dcp_to_hf as dcp_to_hf_module
from titan_core.convert.dcp_to_hf import hf_config
from titan_core.errors import CheckpointError, ConfigError
from titan_core.models import describe_model, get_model_spec, model_from_description
from titan_core.models.common.hf_fp8 import dequantize_block
from titan_core.models.common.moe import MoE, MoEArgs, moe_layers
from titan_core.models.common.rope import YarnScaling
from titan_core.models.deepseek_v3 import DeepseekV3Model, DeepseekV3ModelArgs, deepseek_v3_flavors
from titan_core.models.deepseek_v3.state_dict_adapter import (
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)
from titan_core.resolve import parse_args

transformers = pytest.importorskip("transformers")

TINY = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel_tiny"]
PUBLISHED = {  # (total, activated) without the MTP layer, as the model cards count them
    "16B-A3B": (15_960_108_544, 2_914_774_528),
    "671B-A37B": (671_026_404_352, 37_552_282_624),
    "1T-A32B": (1_026_408_209_408, 32_861_477_888),
}


# ---------------------------------------------------------------- helpers
def _tiny_args(q_lora: int = 32, interleave: bool = True, **overrides: Any) -> DeepseekV3ModelArgs:
    """The tiny flavor (MLA with qk 16 + 8 and v 16 channels, a dense first layer, 8 experts in
    4 groups of which 2 per token, top-2, a shared expert), with a YaRN whose table magnitude
    and softmax correction both differ from 1."""
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.707)
    fields = dict(vocab_size=256, max_seq_len=64, q_lora_rank=q_lora, rope_interleave=interleave)
    return dataclasses.replace(
        deepseek_v3_flavors["debugmodel_tiny"], rope_scaling=yarn, **{**fields, **overrides}
    )


def _randomize(model: torch.nn.Module) -> None:
    """Norm scales around 1, O(1) router weights and a nonzero expert bias: the expert and group
    choice (near uniform at init) and the bias's selection-only role all matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "router.gate.weight")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.normal_(0.0, 0.05)


def _hf_model(args: DeepseekV3ModelArgs) -> Any:
    """A randomly initialized ``DeepseekV3ForCausalLM`` of ``args``' shape."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config.from_dict(to_hf_config(args))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    _randomize(model)
    return model


def _engine_model(args: DeepseekV3ModelArgs, seed: int = 2) -> DeepseekV3Model:
    torch.manual_seed(seed)
    model = DeepseekV3Model(args)
    model.init_weights()
    _randomize(model)
    return model.eval()


def _capture_moe_inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inputs: dict[str, torch.Tensor] = {}
    for name, moe in moe_layers(model).items():
        moe.register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, a[0]))
    return inputs


def _groups_excluded(moe: MoE, x: torch.Tensor) -> int:
    """Tokens whose routed experts differ from an unrestricted top-k of the same selection
    scores; asserts every token stays within its ``top_groups`` groups."""
    tokens = x.reshape(-1, x.shape[-1])
    _, ids, _ = moe.router(tokens, moe.expert_bias)
    select = torch.sigmoid(moe.router.gate(tokens).float()) + moe.expert_bias
    free = torch.topk(select, moe.args.top_k, dim=-1).indices
    per_group = moe.args.num_experts // moe.args.num_groups
    assert all(len(set(row.tolist())) <= moe.args.top_groups for row in ids // per_group)
    return sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, free, strict=True))


# ---------------------------------------------------------------- logits parity
@pytest.mark.parametrize(
    ("q_lora", "interleave"), [(32, True), (0, False)], ids=["q_lora-interleave", "wq-rotate_half"]
)
def test_logits_match_transformers_both_ways(q_lora: int, interleave: bool, tmp_path: Path) -> None:
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    # HF -> engine: transformers' in-memory (fused) experts and its expert bias, strict load.
    # transformers builds no MTP layer: the engine model gets none either.
    hf = _hf_model(_tiny_args(q_lora, interleave, mtp_layers=0))
    args = from_hf_config(hf.config.to_dict(), "config.json")
    assert args == _tiny_args(q_lora, interleave, mtp_layers=0)
    ours = DeepseekV3Model(args).eval()
    assert sorted(moe_layers(ours)) == ["layers.1", "layers.2"]  # layer 0 dense
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    inputs = _capture_moe_inputs(ours)
    with torch.no_grad():
        assert rel_diff(ours(tokens), hf(tokens).logits) <= 1e-5
        excluded = [_groups_excluded(m, inputs[n]) for n, m in moe_layers(ours).items()]
    assert sum(excluded) > 0, "no token lost an expert to the group limit: the test is void"

    # Engine -> HF: the engine's init with one MTP block, exported per expert to a folder that
    # transformers loads: nothing missing, only the MTP layer unexpected (it has none).
    args = dataclasses.replace(args, mtp_layers=1)
    ours = _engine_model(args)
    exported = to_hf(ours.state_dict(), args)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in exported
    assert "model.layers.3.eh_proj.weight" in exported and "model.layers.3.enorm.weight" in exported
    assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(exported, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_config(args, "float32", None, None)))
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        folder, local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert info["unexpected_keys"] and all(
        k.startswith("model.layers.3.") for k in info["unexpected_keys"]
    )
    with torch.no_grad():
        assert rel_diff(ours(tokens), hf.eval()(tokens).logits) <= 1e-5


def test_partial_state_dicts_convert_key_by_key() -> None:
    """dcp-to-hf converts one native tensor at a time: a stacked expert weight gives its E
    expert tensors, the expert bias is the router's correction bias, MTP blocks keep the
    published names; the published MTP layer's copies of the embedding and head are dropped."""
    args = _tiny_args(mtp_layers=1)
    w1 = torch.randn(8, 32, 64)
    out = to_hf({"layers.1.moe.experts.w1": w1}, args)
    assert list(out) == [f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(8)]
    assert torch.equal(from_hf(out, args)["layers.1.moe.experts.w1"], w1)
    names = {
        "layers.2.moe.expert_bias": "model.layers.2.mlp.gate.e_score_correction_bias",
        "layers.3.mtp_input.eh_proj.weight": "model.layers.3.eh_proj.weight",
        "layers.3.head_norm.weight": "model.layers.3.shared_head.norm.weight",
        "layers.0.attention.wkv_a.weight": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    }
    for native, hf_name in names.items():
        assert list(to_hf({native: torch.zeros(2, 2)}, args)) == [hf_name]
    shared = {
        "model.layers.3.embed_tokens.weight": torch.zeros(256, 64),
        "model.layers.3.shared_head.head.weight": torch.zeros(256, 64),
        "model.layers.4.enorm.weight": torch.zeros(64),  # past the model's MTP depth
    }
    assert from_hf(shared, args) == {}
    del out["model.layers.1.mlp.experts.5.gate_proj.weight"]
    with pytest.raises(CheckpointError, match=r"^from_hf: layers\.1\.moe\.experts\.w1: expert 5 "):
        from_hf(out, args)


@pytest.mark.parametrize("flavor", list(deepseek_v3_flavors))
def test_hf_config_gives_back_the_model_args(flavor: str) -> None:
    args = deepseek_v3_flavors[flavor]
    config = json.loads(json.dumps(hf_config(args, "bfloat16", None, "deepseek_v3")))
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert from_hf_config(config, "config.json") == args
    hf = transformers.DeepseekV3Config.from_dict(config)
    assert (hf.n_group, hf.topk_group) == (args.moe.num_groups, args.moe.top_groups)
    assert from_hf_config(hf.to_dict(), "config.json") == args
    described = json.loads(json.dumps(describe_model("deepseek_v3", args)))
    assert model_from_description(described, "m") == ("deepseek_v3", args)


def test_published_parameter_counts_match_transformers() -> None:
    """Moonlight-16B-A3B, DeepSeek-V3 and Kimi K2 shapes: the args count what transformers
    builds (no MTP layer there), and the MTP layer adds one MoE block and its projection."""
    moe_layer = 0
    for flavor, counts in PUBLISHED.items():
        args = deepseek_v3_flavors[flavor]
        config = transformers.DeepseekV3Config.from_dict(to_hf_config(args))
        with torch.device("meta"):
            hf = transformers.DeepseekV3ForCausalLM(config)
        main = dataclasses.replace(args, mtp_layers=0)
        assert main.param_counts() == counts, flavor
        assert main.num_params() == sum(p.numel() for p in hf.parameters()), flavor
        if flavor == "671B-A37B":
            moe_layer = sum(p.numel() for p in hf.model.layers[-1].parameters())
    # DeepSeek-V3's MTP layer: an MoE layer plus enorm, hnorm, shared_head.norm and eh_proj
    # (the card's 685B less the 671B and the layer's copies of the embedding and head).
    v3 = deepseek_v3_flavors["671B-A37B"]
    with torch.device("meta"):
        model = DeepseekV3Model(v3)
    assert v3.num_params() == sum(p.numel() for p in model.parameters())
    assert v3.num_params() - PUBLISHED["671B-A37B"][0] == moe_layer + 3 * 7168 + 2 * 7168**2


# ---------------------------------------------------------------- conversion through the CLI
@pytest.mark.parametrize("source", ["transformers", "engine_with_mtp"])
def test_hf_to_dcp_to_hf_is_bitwise(
    source: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """HF -> DCP -> HF, every tensor equal bit for bit, streamed and in memory: a
    transformers-written folder (no MTP layer), and an engine export carrying its MTP layer."""
    from titan_core.data import Tokenizer, default_tokenizer_path

    vocab = Tokenizer(str(default_tokenizer_path())).n_words
    hf_dir = tmp_path / "hf"
    if source == "transformers":
        args = _tiny_args(vocab_size=vocab, max_seq_len=2048, mtp_layers=0)
        _hf_model(args).save_pretrained(hf_dir)
    else:
        args = _tiny_args(
            vocab_size=vocab, max_seq_len=2048, mtp_layers=1, q_lora=0, interleave=False
        )
        hf_dir.mkdir()
        save_file(to_hf(_engine_model(args).state_dict(), args), hf_dir / "model.safetensors")
        (hf_dir / "config.json").write_text(json.dumps(hf_config(args, "float32", None, None)))
    original = hf_tensors(hf_dir)
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in original
    assert ("model.layers.3.eh_proj.weight" in original) is (args.mtp_layers == 1)
    rc, err = convert_cli(
        ["hf-to-dcp", "--hf", str(hf_dir), "--output", str(tmp_path / "dcp")], capsys
    )
    assert rc == 0, err
    assert dcp_model(tmp_path / "dcp")["layers.1.moe.experts.w2"].shape == (8, 64, 32)
    argv = ["dcp-to-hf", "--checkpoint", str(tmp_path / "dcp"), "--dtype", "fp32", "--no-progress"]
    rc, err = convert_cli([*argv, "--output", str(tmp_path / "direct")], capsys)
    assert rc == 0, err
    assert_bitwise(original, hf_tensors(tmp_path / "direct"))
    config = json.loads((tmp_path / "direct" / "config.json").read_text())
    assert from_hf_config(config, "config.json") == args
    monkeypatch.setattr(dcp_to_hf_module, "locate_direct", lambda *a, **k: {})
    rc, err = convert_cli([*argv, "--output", str(tmp_path / "in_memory")], capsys)
    assert rc == 0, err
    assert_bitwise(original, hf_tensors(tmp_path / "in_memory"))


def _quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as float8_e4m3fn with one float32 ``scale_inv`` per (block x block) tile (the last
    tiles partial), as DeepSeek's checkpoints store it."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, scale


def test_fp8_block_scaled_checkpoint_reads_as_its_dequantized_original(tmp_path: Path) -> None:
    """Every projection (experts included) stored as FP8 + ``weight_scale_inv``, written to and
    read from safetensors: the same native weights, bit for bit, as the float32 checkpoint of
    the dequantized values; multi-tile shapes with partial tiles dequantize tile by tile."""
    args = _tiny_args(mtp_layers=1)
    original = to_hf(_engine_model(args).state_dict(), args)
    quantized, dequantized = {}, {}
    for name, w in original.items():
        if w.dim() == 2 and name.endswith("proj.weight"):
            q, scale = _quantize(w)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            tiles = torch.kron(scale, torch.ones(128, 128))[: w.shape[0], : w.shape[1]]
            dequantized[name] = q.float() * tiles
        else:
            quantized[name] = dequantized[name] = w
    assert sum(k.endswith("_scale_inv") for k in quantized) > 40
    save_file(quantized, tmp_path / "model.safetensors")
    native = from_hf(load_file(tmp_path / "model.safetensors"), args)
    expected = from_hf(dequantized, args)
    assert sorted(native) == sorted(expected)
    for k, v in expected.items():
        assert native[k].dtype == v.dtype == torch.float32 and torch.equal(native[k], v), k
    assert not torch.equal(
        native["layers.1.moe.experts.w1"], from_hf(original, args)["layers.1.moe.experts.w1"]
    )

    w = torch.randn(300, 260)
    q, scale = _quantize(w)
    assert scale.shape == (3, 3)
    tiles = q.float().view(300, 260)
    back = dequantize_block(q, scale, torch.float32)
    assert torch.equal(back[256:, 256:], tiles[256:, 256:] * scale[2, 2])
    assert torch.equal(back[:128, 128:256], tiles[:128, 128:256] * scale[0, 1])
    with pytest.raises(CheckpointError, match=r"^from_hf: model\.layers\.0\.x\.weight_scale_inv: "):
        from_hf({"model.layers.0.x.weight_scale_inv": scale}, args)


def _published_folder(folder: Path, args: DeepseekV3ModelArgs) -> dict[str, torch.Tensor]:
    """An HF folder laid out as DeepSeek publishes V3: every projection FP8 with its block
    scales, the MTP layer carrying copies of the embedding and head; returns the
    dequantized tensors it stands for."""
    original = to_hf(_engine_model(args).state_dict(), args)
    stored, dequantized = {}, {}
    for name, w in original.items():
        if w.dim() == 2 and name.endswith("proj.weight"):
            q, scale = _quantize(w)
            stored[name], stored[name + "_scale_inv"] = q, scale
            dequantized[name] = (
                q.float() * torch.kron(scale, torch.ones(128, 128))[: w.shape[0], : w.shape[1]]
            )
        else:
            stored[name] = dequantized[name] = w
    mtp = f"model.layers.{args.n_layers}"
    stored[f"{mtp}.embed_tokens.weight"] = original["model.embed_tokens.weight"].clone()
    stored[f"{mtp}.shared_head.head.weight"] = original["lm_head.weight"].clone()
    folder.mkdir()
    save_file(stored, folder / "model.safetensors")
    config = {**to_hf_config(args), "quantization_config": {"quant_method": "fp8"}}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def test_published_fp8_folder_converts_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``titan convert hf-to-dcp`` of a DeepSeek-published layout (FP8 + ``weight_scale_inv``,
    the MTP layer's embedding and head copies): the checkpoint is the dequantized weights;
    a scale of the wrong shape, or an unknown tensor, is still one line."""
    args = _tiny_args(max_seq_len=2048, mtp_layers=1)
    hf_dir = tmp_path / "hf"
    dequantized = _published_folder(hf_dir, args)
    rc, err = convert_cli(
        ["hf-to-dcp", "--hf", str(hf_dir), "--output", str(tmp_path / "dcp")], capsys
    )
    assert rc == 0, err
    got = dcp_model(tmp_path / "dcp")
    expected = from_hf(dequantized, args)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name

    stored = load_file(hf_dir / "model.safetensors")
    for name, value, message in (
        ("model.layers.1.mlp.experts.0.up_proj.weight_scale_inv", torch.ones(2, 1),
         r"tensor model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight_scale_inv in .* has "
         r"shape \(2, 1\), expected \(1, 1\)"),
        ("model.layers.1.embed_tokens.weight", torch.ones(256, 64),
         r"unknown tensor model\.layers\.1\.embed_tokens\.weight in "),
    ):  # fmt: skip
        save_file({**stored, name: value}, hf_dir / "model.safetensors")
        rc, err = convert_cli(
            ["hf-to-dcp", "--hf", str(hf_dir), "--output", str(tmp_path / name)], capsys
        )
        assert rc != 0 and re.search(message, err) and len(err.strip().splitlines()) == 1, err


def test_transformers_folder_without_the_mtp_layer_starts_it_fresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``save_pretrained`` folder keeps ``num_nextn_predict_layers: 1`` but drops the MTP
    layer: hf-to-dcp (and ``initial_load_in_hf``) take the rest bit for bit and the MTP
    layer from the model's initialization, after one warning line; a folder holding part of
    that layer is refused as missing the rest."""
    from titan_core.checkpoint.hf_weights import load_hf_into_model

    args = _tiny_args(max_seq_len=2048, mtp_layers=1)
    hf_dir = tmp_path / "hf"
    _hf_model(args).save_pretrained(hf_dir)
    original = hf_tensors(hf_dir)
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(k.startswith("model.layers.3.") for k in original)
    capsys.readouterr()
    rc = convert_main(["hf-to-dcp", "--hf", str(hf_dir), "--output", str(tmp_path / "dcp")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    warning = [line for line in out.splitlines() if "multi-token prediction layer" in line]
    exported = to_hf(_engine_model(args).state_dict(), args)
    layer = [k for k in exported if k.startswith("model.layers.3.")]
    assert len(warning) == 1 and f"has none of the {len(layer)} tensors" in warning[0], out
    got = dcp_model(tmp_path / "dcp")
    assert sorted(got) == sorted(DeepseekV3Model(args).state_dict())
    for name, value in from_hf(original, args).items():
        assert torch.equal(got[name], value), name
    assert torch.equal(got["layers.3.head_norm.weight"], torch.ones(64))
    assert 0.01 < got["layers.3.mtp_input.eh_proj.weight"].std() < 0.03  # init std 0.02

    model = _engine_model(args)
    fresh = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("layers.3.")}
    load_hf_into_model(str(hf_dir), model)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in fresh.items())
    assert torch.equal(state["layers.1.moe.experts.w1"], got["layers.1.moe.experts.w1"])

    save_file(
        {**original, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)},
        hf_dir / "model.safetensors",
    )
    rc, err = convert_cli(
        ["hf-to-dcp", "--hf", str(hf_dir), "--output", str(tmp_path / "x")], capsys
    )
    assert rc != 0 and "missing in" in err and "model.layers.3." in err, err


# ---------------------------------------------------------------- multi-token prediction
def test_mtp_loss_reaches_the_gradient_and_never_the_logits() -> None:
    """In training the MTP blocks' mean loss, times its weight and scale, is in every
    gradient exactly as if added to the loss; logits are the same with and without MTP."""
    args = _tiny_args(mtp_layers=2, mtp_loss_weight=0.25)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    model = _engine_model(args).train()
    model.mtp_loss_scale = 0.5
    logits = model(tokens)
    (logits.float().logsumexp(-1).mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert "layers.4.mtp_input.eh_proj.weight" in grads and model.mtp_loss > 0
    model.zero_grad()
    model.mtp_loss_scale = 0.0  # the MTP term off: add it by hand instead
    logits = model(tokens)
    h = {}
    model.norm.register_forward_pre_hook(lambda m, a: h.__setitem__("h", a[0]))
    from titan_core.models.common.mtp import labels_ahead, mtp_losses

    logits = model(tokens)
    blocks = [model.layers["3"], model.layers["4"]]
    ahead = labels_ahead(torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1), 2)
    losses = mtp_losses(h["h"], ahead, blocks, model.tok_embeddings, model.output, model.freqs_cis)
    (logits.float().logsumexp(-1).mean() + 0.25 * 0.5 * torch.stack(losses).mean()).backward()
    for n, g in grads.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, rtol=1e-5, atol=1e-7, msg=n)

    plain = DeepseekV3Model(dataclasses.replace(args, mtp_layers=0)).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert torch.equal(plain(tokens), model.eval()(tokens))


def test_mtp_over_the_whole_window_equals_deepseeks_cut_window() -> None:
    """Depth k keeps all seq positions (so it splits along the sequence under TP and CP) and
    ignores the last k targets: its loss equals DeepSeek-V3's definition, the block run on the
    first seq - k positions only with the embeddings of tokens k ahead, to fp32 rounding."""
    import torch.nn.functional as F

    from titan_core.models.common.mtp import labels_ahead, mtp_losses

    args = _tiny_args(mtp_layers=2)
    model = _engine_model(args).train()
    window = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(7))
    tokens, labels = window[:, :-1], window[:, 1:]
    h = {}
    model.norm.register_forward_pre_hook(lambda m, a: h.__setitem__("h", a[0]))
    model(tokens, labels_ahead=labels_ahead(labels, 2))  # training: the MTP loss kept
    with torch.no_grad():
        blocks = [model.layers["3"], model.layers["4"]]
        kept = mtp_losses(
            h["h"],
            labels_ahead(labels, 2),
            blocks,
            model.tok_embeddings,
            model.output,
            model.freqs_cis,
        )
        cut, prev, seq = [], h["h"], tokens.shape[1]
        for k, block in enumerate(blocks, start=1):
            n = seq - k
            prev, normed = block(
                prev[:, :n], model.tok_embeddings(window[:, k : k + n]), model.freqs_cis
            )
            logits = model.output(normed).float()
            cut.append(
                F.cross_entropy(logits.flatten(0, 1), window[:, k + 1 : k + 1 + n].flatten())
            )
    assert len(kept) == 2
    for ours, theirs in zip(kept, cut, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.mtp_loss, torch.stack(kept).mean(), rtol=1e-6, atol=0)


def test_trained_checkpoint_exports_and_generates_like_the_engine(
    tmp_path: Path, assets: Path
) -> None:
    """2 engine training steps (MTP on, its MoE block's load counted) -> dcp-to-hf ->
    AutoModelForCausalLM: same logits, same greedy tokens."""
    flavor = deepseek_v3_flavors["debugmodel_tiny"]
    assert_export_generates_like_the_engine(
        tmp_path, TINY, DeepseekV3Model, flavor, "DeepseekV3ForCausalLM"
    )


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"topk_group": 5}, "topk_group 5 must be between 1 and n_group 4"),
        ({"n_routed_experts": 10}, "n_routed_experts 10 is not divisible by n_group 4"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and the 4 experts"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"kv_lora_rank": None}, "lacks kv_lora_rank"),
        (
            {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
            "architectures ['DeepseekV2ForCausalLM'] is not supported",
        ),
    ],
    ids=["topk_group", "groups_divide", "top_k", "softmax", "no_kv_lora", "deepseek_v2"],
)
def test_hf_to_dcp_refuses_what_it_cannot_read(
    config: dict[str, Any], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_hf_to_dcp_refuses(to_hf_config(_tiny_args()), config, expected, tmp_path, capsys)


def test_bad_shapes_and_other_architectures_are_one_line() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(
        CheckpointError,
        match=r"^hf: c\.json: architectures \['LlamaForCausalLM'\] is not DeepseekV3ForCausalLM",
    ):
        from_hf_config({**to_hf_config(_tiny_args()), **llama}, "c.json")
    with pytest.raises(
        ConfigError, match=r"^model\.moe\.top_groups: 5 must be between 1 and num_groups \(4\)$"
    ):
        MoEArgs(num_experts=8, num_groups=4, top_groups=5)
    with pytest.raises(
        ConfigError, match=r"^model\.moe\.num_groups: 3 must be >= 1 and divide num_experts \(8\)$"
    ):
        MoEArgs(num_experts=8, num_groups=3)
    spec = get_model_spec("deepseek_v3")
    cfg = parse_args(TINY)
    dims = SimpleNamespace(tp=1, pp=2, cp=1)
    with pytest.raises(
        ConfigError,
        match=r"^parallelism\.pipeline_parallel_degree: 2 does not run multi-token prediction",
    ):
        spec.check(dims, cfg, "cpu", deepseek_v3_flavors["debugmodel_tiny"])


def test_tiny_recipe_trains_with_the_mtp_block_counted(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``titan train`` of the tiny recipe, gradient accumulation 2: finite losses, the MTP
    loss logged as ``mtp/loss`` at every step in metrics.jsonl and the MLflow run (near the
    next-token loss at init: both predict a fresh model's tokens), and the MTP block's MoE
    (layer 3, past ``n_layers``) has its expert-load metrics like the others. The trainer's
    model line counts the parameters as ``titan estimate`` does, MTP apart."""
    from mlflow import MlflowClient

    from titan_core.components.mlflow_sink import RUN_ID_ENV, TRACKING_URI_ENV
    from titan_core.estimate import estimate
    from titan_core.train import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("mtp", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    monkeypatch.setenv(RUN_ID_ENV, run_id)
    monkeypatch.setenv(TRACKING_URI_ENV, uri)
    argv = [*TINY, "--training.steps", "3", "--metrics.log_freq", "1", "--validation.no_enable"]
    argv += ["--training.gradient_accumulation_steps", "2", "--training.local_batch_size", "2"]
    argv += ["--checkpoint.no_enable", "--job.dump_folder", str(tmp_path / "run")]
    logged = run(parse_args(argv))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in logged)
    assert {"moe/layer1/load_max", "moe/layer3/load_max"} <= set(logged[-1])
    layout = estimate(parse_args(argv), 1).layout
    out = capsys.readouterr().out
    model_line = next(line for line in out.splitlines() if " Model deepseek_v3 " in line)
    assert layout.num_mtp_params > 0, layout
    assert (
        f": {layout.num_params:,} parameters ({layout.num_activated_params:,} activated) + "
        f"multi-token prediction {layout.num_mtp_params:,} "
        f"({layout.num_mtp_activated_params:,} activated), "
    ) in model_line, model_line
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(abs(r["mtp/loss"] - r["loss"]) < 0.5 for r in rows[:1]), rows[0]
    history = {m.step: m.value for m in client.get_metric_history(run_id, "mtp/loss")}
    assert history == {r["step"]: pytest.approx(r["mtp/loss"]) for r in rows}


def test_mtp_settings_reach_the_model_args() -> None:
    """``--model.mtp_layers`` / ``--model.mtp_loss_weight`` override the flavor's; a family
    without multi-token prediction refuses them in one line."""
    from titan_core.build import flavor_args

    args = flavor_args(
        parse_args([*TINY, "--model.mtp_layers", "2", "--model.mtp_loss_weight", "0.1"])
    )
    assert (args.mtp_layers, args.mtp_loss_weight) == (2, pytest.approx(0.1))
    llama = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    with pytest.raises(ConfigError, match=r"^model\.mtp_loss_weight: llama3 has no multi-token"):
        flavor_args(parse_args([*llama, "--model.mtp_loss_weight", "0.1"]))


def test_mtp_gradient_with_accumulation_equals_the_whole_batch(tmp_path: Path) -> None:
    """One global batch of 4 sequences as 1 microbatch or as 2 of 2: every gradient equal
    within fp32 tolerance, the MTP-only ones (``eh_proj``) included, which a missing
    1 / accumulation factor on the MTP loss would double; the forward gets the targets ahead."""
    from titan_core.models.common.mtp import labels_ahead
    from titan_core.trainer import Trainer

    def grads(accumulation: int) -> dict[str, torch.Tensor]:
        argv = [*TINY, "--training.local_batch_size", str(4 // accumulation)]
        argv += ["--training.gradient_accumulation_steps", str(accumulation)]
        argv += ["--training.max_norm", "1e9", "--validation.no_enable", "--checkpoint.no_enable"]
        argv += ["--job.dump_folder", str(tmp_path / str(accumulation))]
        trainer = Trainer(parse_args(argv))
        try:
            vocab = trainer.model_args.vocab_size
            tokens = torch.randint(0, vocab, (4, 65), generator=torch.Generator().manual_seed(1))
            batches = [
                (part[:, :-1], part[:, 1:]) for part in tokens.chunk(accumulation)
            ]  # (4 / accumulation, 64) each
            seen: list[Any] = []  # the targets ahead each forward got
            trainer.model.register_forward_pre_hook(
                lambda m, a, kw: seen.append(kw.get("labels_ahead")), with_kwargs=True
            )
            trainer.train_step(batches)
            assert all(
                torch.equal(got, labels_ahead(b[1], 1))
                for got, b in zip(seen, batches, strict=True)
            )
            return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        finally:
            trainer.close()

    whole, halves = grads(1), grads(2)
    assert whole["layers.3.mtp_input.eh_proj.weight"].abs().max() > 0
    for name, grad in whole.items():
        torch.testing.assert_close(halves[name], grad, rtol=1e-4, atol=1e-7, msg=name)


# ---------------------------------------------------------------- the pipeline
@pytest.mark.multiprocess
def test_pipeline_trains_evaluates_and_registers_a_deepseek_v3_export(
    prefect_harness: Path, tmp_path: Path
) -> None:
    """``titan pipeline run --module deepseek_v3`` on the tiny recipe: completes through
    convert, evaluate and publish like the other families; the registered export is a
    DeepSeek-V3 folder with its MTP layer, and the eval report has held-out metrics and greedy
    samples of the family's model."""
    from mlflow.tracking import MlflowClient
    from pipeline_helpers import run_flow, tiny_values

    from flows.pipeline import pretrain_pipeline

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    state, _ = run_flow(
        pretrain_pipeline,
        recipe="deepseek_v3/deepseek_v3_debugmodel_tiny",
        config={"job": {"experiment": "dsv3line"}, "evaluate": {"batches": 2}},
        overrides=tiny_values(steps=2, nproc=1)
        | {"job.dump_folder": str(tmp_path / "runs"), "tracking.uri": tracking},
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert (result["model_name"], result["model_version"]) == ("dsv3line", "1")
    version = MlflowClient(tracking_uri=tracking).get_model_version("dsv3line", "1")
    assert version.source == result["hf"]
    hf = Path(result["hf"].removeprefix("file://"))
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    report = json.loads((hf.parent / "eval" / "report.json").read_text())
    assert report["model"]["name"] == "deepseek_v3" and report["step"] == 2
    assert torch.isfinite(torch.tensor(report["metrics"]["loss"]))
    assert report["samples"] and all(s["new_tokens"] for s in report["samples"])
