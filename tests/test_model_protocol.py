"""The model protocol from the outside: self-describing checkpoints (convert, eval and train
with no config), a third family registered from this file that trains, resumes and converts
without engine changes, and bad model input on the CLIs (layering: tests/test_layers.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_helpers import assert_bitwise, dcp_model, hf_tensors
from safetensors.torch import load_file, save_file
from toy_family import TOY_SPEC, ToyArgs

from titan_core.build import build_model_args, check_job
from titan_core.checkpoint.manager import read_marker
from titan_core.cli import convert as convert_cli
from titan_core.cli.evaluate import main as eval_main
from titan_core.convert.dcp_to_hf import hf_config
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.errors import CheckpointError, ConfigError
from titan_core.logging import logger
from titan_core.models import (
    ENTRY_POINT_GROUP,
    describe_model,
    get_model_spec,
    model_from_description,
    register_model_spec,
    unregister_model_spec,
)
from titan_core.resolve import parse_args
from titan_core.train import main as train_main
from titan_core.train import run

ROOT = Path(__file__).resolve().parents[1]
# Each family's tiny recipe (a few seconds of CPU).
FAMILIES = {"llama3": "llama3_debugmodel_tiny", "qwen3": "qwen3_debugmodel_tiny"}
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "64"]
SMALL += ["--lr_scheduler.warmup_steps", "1", "--validation.no_enable", "--metrics.log_freq", "1"]


# ---------------------------------------------------------------- self-describing checkpoints
@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, assets: Path
) -> dict[str, Any]:
    """An HF folder of a freshly initialized tiny model of the family, and the DCP checkpoint
    ``titan convert hf-to-dcp`` makes of it (no config.toml anywhere near)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"imported_{family}")
    cfg = parse_args(["--module", family, "--config", FAMILIES[family]])
    args = build_model_args(cfg, Tokenizer(str(default_tokenizer_path())).n_words)
    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    hf = root / "hf"
    hf.mkdir()
    tensors = spec.hf.to_hf(model.state_dict(), args)
    save_file({k: v.contiguous() for k, v in tensors.items()}, hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps(hf_config(args, "float32", None, family)))
    dcp = root / "dcp"
    assert convert_cli.main(["hf-to-dcp", "--hf", str(hf), "--output", str(dcp)]) == 0
    nparams = sum(p.numel() for p in model.parameters())
    return {"family": family, "args": args, "hf": hf, "dcp": dcp, "nparams": nparams}


def test_description_round_trips_every_flavor() -> None:
    """describe_model -> JSON -> model_from_description gives the same args (nested RopeScaling
    included); an unknown field names the source."""
    for family in FAMILIES:
        for flavor, args in get_model_spec(family).flavors.items():
            described = json.loads(json.dumps(describe_model(family, args)))
            assert model_from_description(described, "m") == (family, args), flavor
    bad = describe_model("llama3", get_model_spec("llama3").flavors["debugmodel"])
    bad["args"]["n_experts"] = 8
    with pytest.raises(CheckpointError, match=r"^m: .*'n_experts'"):
        model_from_description(bad, "m")


def test_hf_to_dcp_to_hf_needs_no_config(imported: dict[str, Any], tmp_path: Path) -> None:
    marker = read_marker(str(imported["dcp"]))
    assert marker is not None and marker["model"]["name"] == imported["family"]
    out = tmp_path / "hf"
    argv = ["dcp-to-hf", "--checkpoint", str(imported["dcp"]), "--output", str(out)]
    assert convert_cli.main([*argv, "--dtype", "fp32", "--no-progress"]) == 0
    assert_bitwise(hf_tensors(out), load_file(imported["hf"] / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    source = json.loads((imported["hf"] / "config.json").read_text())
    assert {k: config[k] for k in source} == source


def test_eval_needs_no_config(imported: dict[str, Any], tmp_path: Path) -> None:
    argv = ["--checkpoint", str(imported["dcp"]), "--output", str(tmp_path), "--max-batches", "1"]
    assert eval_main([*argv, "--prompts", "--validation.local_batch_size", "2"]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["model"]["name"] == imported["family"]
    assert report["model"]["vocab_size"] == imported["args"].vocab_size


def test_training_builds_the_checkpoint_model(
    imported: dict[str, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`titan train --checkpoint.initial_load_path DCP` alone trains the model DCP holds, and its
    own checkpoints describe that model in turn."""
    monkeypatch.setattr(logger, "propagate", True)
    run = tmp_path / "run"
    argv = ["--checkpoint.initial_load_path", str(imported["dcp"]), "--training.steps", "2"]
    argv += ["--checkpoint.enable", "--job.dump_folder", str(run), *SMALL]
    with caplog.at_level(logging.INFO, logger="titan"):
        assert train_main(argv) == 0
    family, nparams = imported["family"], imported["nparams"]
    assert f"Model {family} checkpoint: {nparams:,} parameters" in caplog.text
    assert "Loading ['model'] from initial_load_path" in caplog.text
    name, args = model_from_description(
        read_marker(str(run / "checkpoint" / "step-2"))["model"], ""
    )
    assert name == family and args == imported["args"]


def test_checkpoint_flavor_resolution(imported: dict[str, Any]) -> None:
    """The checkpoint's model is taken only when the user named none; its vocabulary is kept."""
    load = ["--checkpoint.initial_load_path", str(imported["dcp"])]
    cfg = parse_args(load)
    assert (cfg.model.name, cfg.model.flavor) == (imported["family"], "checkpoint")
    assert build_model_args(cfg, 100).vocab_size == imported["args"].vocab_size
    assert parse_args([*load, "--model.flavor", "debugmodel"]).model.name == "llama3"
    recipe = parse_args(["--module", "qwen3", "--config", "qwen3_debugmodel", *load]).model
    assert (recipe.name, recipe.flavor) == ("qwen3", "debugmodel")
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: the model of .* fewer than"):
        build_model_args(cfg, imported["args"].vocab_size + 1)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: the model of .* got 7"):
        build_model_args(parse_args([*load, "--model.vocab_size", "7"]), 1)
    with pytest.raises(ConfigError, match=r"^model\.flavor: 'checkpoint' builds the model"):
        build_model_args(parse_args(["--model.flavor", "checkpoint"]), 1)


# ---------------------------------------------------------------- a third family, from outside
@pytest.fixture
def toy_family() -> Iterator[None]:
    """The toy family registered in this process for one test (the entry point test below
    reaches new processes); unregistered after, so other tests see the built-in families only."""
    register_model_spec(TOY_SPEC)
    yield
    unregister_model_spec(TOY_SPEC.name)


@pytest.mark.usefixtures("toy_family")
def test_third_family_trains_resumes_and_converts(tmp_path: Path, assets: Path) -> None:
    """A family the engine has never heard of trains, resumes exactly, converts both ways
    (its own HF names and config.json) and refuses pipeline parallelism with one line."""
    toy = ["--module", "toy", "--config", "toy_tiny"]
    straight = run(parse_args([*toy, "--job.dump_folder", str(tmp_path / "straight")]))
    argv = [*toy, "--job.dump_folder", str(tmp_path / "run")]
    first = run(parse_args([*argv, "--training.steps", "2"]))
    resumed = run(parse_args(argv))  # finds step-2 and goes on to step 4
    assert [h["step"] for h in first + resumed if "loss" in h] == [1, 2, 3, 4]
    assert [h["loss"] for h in first + resumed if "loss" in h] == [
        h["loss"] for h in straight if "loss" in h
    ]
    step = tmp_path / "run" / "checkpoint" / "step-4"
    assert read_marker(str(step))["model"] == describe_model("toy", ToyArgs(vocab_size=_vocab()))
    hf = tmp_path / "hf"
    argv = ["dcp-to-hf", "--checkpoint", str(step), "--output", str(hf), "--dtype", "fp32"]
    assert convert_cli.main(argv) == 0
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["ToyForCausalLM"]
    weights = dcp_model(step)
    assert_bitwise(hf_tensors(hf), TOY_SPEC.hf.to_hf(weights, ToyArgs()))
    assert convert_cli.main(["hf-to-dcp", "--hf", str(hf), "--output", str(tmp_path / "back")]) == 0
    assert_bitwise(dcp_model(tmp_path / "back"), weights)
    cfg = parse_args([*toy, "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match=r"^parallelism\.pipeline_parallel_degree: the toy"):
        check_job(cfg, world_size=2)


def _vocab() -> int:
    return Tokenizer(str(default_tokenizer_path())).n_words


def test_plugin_entry_point_reaches_every_process(tmp_path: Path, assets: Path) -> None:
    """An installed distribution's ``titan.models`` entry point makes the family available to
    a fresh ``python -m titan_core.train`` (as to every torchrun rank), with no import of it."""
    dist_info = tmp_path / "site" / "toy_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ntoy = toy_family:TOY_SPEC\n"
    )
    path = [str(tmp_path / "site"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "titan_core.train", "--module", "toy", "--config", "toy_tiny"]
    cmd += ["--training.steps", "1", "--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Model toy tiny: " in proc.stdout
    assert read_marker(str(tmp_path / "run" / "checkpoint" / "step-1"))["model"]["name"] == "toy"


# ---------------------------------------------------------------- bad model input on the CLIs
def _unsupported_hf(folder: Path) -> list[str]:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return ["convert", "hf-to-dcp", "--hf", str(folder), "--output"]


QWEN3_TINY = ["train", "--module", "qwen3", "--config", "qwen3_debugmodel_tiny"]
_BAD_MODEL = {
    "unknown-family": (
        lambda tmp: ["train", "--module", "gpt", "--config", "x", "--job.dump_folder"],
        "--module 'gpt': unknown model family; choices: deepseek_v3, llama3, qwen3",
    ),
    "flavor-of-another-family": (
        lambda tmp: [*QWEN3_TINY, "--model.flavor", "70B", "--job.dump_folder"],
        "model.flavor: expected one of",
    ),
    "unsupported-hf-architecture": (
        lambda tmp: _unsupported_hf(tmp / "gpt2"),
        "config.json: architectures ['GPT2LMHeadModel'] is not supported; supported: "
        "DeepseekV3ForCausalLM (deepseek_v3), LlamaForCausalLM (llama3)",
    ),
}


@pytest.mark.parametrize("case", list(_BAD_MODEL))
def test_bad_model_input_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], assets: Path
) -> None:
    from titan_core.cli import main as titan

    argv, expected = _BAD_MODEL[case]
    capsys.readouterr()
    assert titan([*argv(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    if case == "flavor-of-another-family":
        assert "got '70B' ('70B' is a flavor of llama3)" in err, err
    assert not (tmp_path / "out").exists()
