"""The Qwen3 dense family against ``transformers``: logits, conversion both ways through the CLI,
export + greedy generation, published parameter counts, refusals, and one pipeline run."""

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
    hf_tensors,
    rel_diff,
)

from titan_core.convert.dcp_to_hf import hf_config
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_flavors
from titan_core.models.qwen3.state_dict_adapter import (
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

transformers = pytest.importorskip("transformers")

TINY = ["--module", "qwen3", "--config", "qwen3_debugmodel_tiny"]
# (hidden, layers, heads, intermediate, tied) of Qwen/Qwen3-*/config.json; all have 8 kv heads
# of head_dim 128, vocabulary 151936, rope theta 1e6 and rms eps 1e-6.
PUBLISHED = {
    "0.6B": (1024, 28, 16, 3072, True),
    "1.7B": (2048, 28, 16, 6144, True),
    "4B": (2560, 36, 32, 9728, True),
    "8B": (4096, 36, 32, 12288, False),
    "14B": (5120, 40, 40, 17408, False),
    "32B": (5120, 64, 64, 25600, False),
}


# ---------------------------------------------------------------- helpers
def _tiny_args(tied: bool, vocab: int = 256) -> Qwen3ModelArgs:
    """The tiny flavor (head_dim 32 != 64 / 4 heads, GQA 4/2) with a chosen vocabulary."""
    args = dataclasses.replace(qwen3_flavors["debugmodel_tiny"], vocab_size=vocab)
    return dataclasses.replace(args, tie_word_embeddings=tied, max_seq_len=128)


def _hf_model(args: Qwen3ModelArgs) -> Any:
    """A randomly initialized ``Qwen3ForCausalLM`` of ``args``' shape, from the adapter's config
    (norm scales randomized too, so that the QK-norm permutation is exercised)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config.from_dict(to_hf_config(args))
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


# ---------------------------------------------------------------- logits parity
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers_both_ways(tied: bool) -> None:
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    # HF -> engine: config.json and weights read back through the adapter, strict load.
    hf = _hf_model(_tiny_args(tied))
    args = from_hf_config(hf.config.to_dict(), "config.json")
    assert args.head_dim * args.n_heads != args.dim and args.num_kv_heads < args.n_heads
    assert args.tie_word_embeddings is tied
    ours = Qwen3Model(args).eval()
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    with torch.no_grad():
        assert rel_diff(ours(tokens), hf(tokens).logits) <= 1e-5

    # Engine -> HF: the engine's own init (norm scales randomized), exported through to_hf.
    torch.manual_seed(2)
    ours = Qwen3Model(args).eval()
    ours.init_weights()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config.from_dict(to_hf_config(args)))
    exported = to_hf(ours.state_dict(), args)
    assert ("lm_head.weight" in exported) is not tied
    missing, unexpected = hf.load_state_dict(exported, strict=False)
    assert unexpected == [] and set(missing) <= ({"lm_head.weight"} if tied else set())
    if tied:
        hf.tie_weights()
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert rel_diff(ours(tokens), hf.eval()(tokens).logits) <= 1e-5


@pytest.mark.parametrize("flavor", list(qwen3_flavors))
def test_hf_config_gives_back_the_model_args(flavor: str) -> None:
    args = qwen3_flavors[flavor]
    config = json.loads(json.dumps(hf_config(args, "bfloat16", None, "qwen3")))
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert from_hf_config(config, "config.json") == args


# ---------------------------------------------------------------- conversion through the CLI
def test_hf_to_dcp_to_hf_is_bitwise(
    tmp_path: Path, assets: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A transformers-written folder -> DCP -> HF again: every tensor equal, bit for bit."""
    vocab = Tokenizer(str(default_tokenizer_path())).n_words
    args = dataclasses.replace(_tiny_args(tied=False, vocab=vocab), max_seq_len=2048)
    _hf_model(args).save_pretrained(tmp_path / "hf")  # fp32, one model.safetensors
    dcp_dir, back = tmp_path / "dcp", tmp_path / "back"
    hf_to_dcp = ["hf-to-dcp", "--hf", str(tmp_path / "hf"), "--output", str(dcp_dir)]
    assert convert_cli(hf_to_dcp, capsys)[0] == 0
    # No --module/--config: the DCP checkpoint names its family and args.
    argv = ["dcp-to-hf", "--checkpoint", str(dcp_dir), "--output", str(back)]
    rc, err = convert_cli([*argv, "--dtype", "fp32", "--no-progress"], capsys)
    assert rc == 0, err
    original, again = hf_tensors(tmp_path / "hf"), hf_tensors(back)
    assert "model.layers.0.self_attn.q_norm.weight" in again
    assert_bitwise(original, again)
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert from_hf_config(config, "config.json") == args


def test_trained_checkpoint_exports_and_generates_like_the_engine(
    tmp_path: Path, assets: Path
) -> None:
    """2 engine training steps -> dcp-to-hf (config found next to the checkpoint) ->
    AutoModelForCausalLM: same logits, same greedy tokens."""
    flavor = qwen3_flavors["debugmodel_tiny"]
    assert_export_generates_like_the_engine(tmp_path, TINY, Qwen3Model, flavor, "Qwen3ForCausalLM")


# ---------------------------------------------------------------- published shapes
def test_published_parameter_counts_match_transformers() -> None:
    for flavor, (hidden, layers, heads, intermediate, tied) in PUBLISHED.items():
        config = transformers.Qwen3Config(
            vocab_size=151936,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=tied,
        )
        with torch.device("meta"):
            hf = transformers.Qwen3ForCausalLM(config)
        args = qwen3_flavors[flavor]
        assert args.tie_word_embeddings is tied and (args.rope_theta, args.norm_eps) == (1e6, 1e-6)
        assert args.num_params() == sum(p.numel() for p in hf.parameters()), flavor
    assert qwen3_flavors["8B"].num_params() == 8_190_735_360


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"head_dim": None}, "lacks head_dim"),
    ],
    ids=["mistral", "sliding_window", "bias", "no_head_dim"],
)
def test_hf_to_dcp_refuses_what_it_cannot_read(
    config: dict[str, Any], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = to_hf_config(_tiny_args(tied=False))
    assert_hf_to_dcp_refuses(base, config, expected, tmp_path, capsys)


def test_args_validation_names_the_key() -> None:
    from titan_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.head_dim: expected an even int > 0, got 31$"):
        Qwen3ModelArgs(head_dim=31)
    with pytest.raises(ConfigError, match=r"^model\.n_kv_heads: expected a divisor"):
        Qwen3ModelArgs(n_heads=32, n_kv_heads=5)


# ---------------------------------------------------------------- the pipeline
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("module", "architecture"),
    [("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")],
)
def test_pipeline_trains_and_registers_a_qwen3_export(
    module: str, architecture: str, prefect_harness: Path, tmp_path: Path
) -> None:
    """``titan pipeline run --module qwen3`` (and ``qwen3_moe``) on the tiny recipe (the full
    debugmodel is minutes of CPU): completes, registers the HF export in MLflow, and the export
    is a folder of the family's architecture."""
    from mlflow.tracking import MlflowClient
    from pipeline_helpers import run_flow, tiny_values

    from flows.pipeline import pretrain_pipeline

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = f"{module}line"
    state, _ = run_flow(
        pretrain_pipeline,
        recipe=f"{module}/{module}_debugmodel_tiny",
        config={"job": {"experiment": experiment}, "evaluate": {"batches": 2}},
        overrides=tiny_values(steps=2, nproc=1)
        | {"job.dump_folder": str(tmp_path / "runs"), "tracking.uri": tracking},
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert (result["model_name"], result["model_version"]) == (experiment, "1")
    version = MlflowClient(tracking_uri=tracking).get_model_version(experiment, "1")
    assert version.source == result["hf"]
    config = json.loads((Path(result["hf"].removeprefix("file://")) / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"] == module
