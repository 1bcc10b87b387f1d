"""MoE in training: the expert-load and aux-loss metrics (JSONL, console, MLflow), the loss-free
bias update, and the aux-loss gradient weighted like the training loss of its forward."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from titan_core.components.loss import cross_entropy_loss
from titan_core.components.mlflow_sink import RUN_ID_ENV, TRACKING_URI_ENV
from titan_core.components.moe_stats import load_metrics
from titan_core.logging import init_logger, logger
from titan_core.models import get_flavor
from titan_core.models.common.moe import moe_layers
from titan_core.resolve import parse_args
from titan_core.train import run
from titan_core.trainer import Trainer

TINY = ["--module", "qwen3_moe", "--config", "qwen3_moe_debugmodel_tiny"]


def _args(dump: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        "4",
        "--training.seq_len",
        "32",
        "--metrics.log_freq",
        "2",
        "--metrics.cpu_peak_tflops",
        "1",
        "--debug.deterministic",
        "--validation.no_enable",
        "--checkpoint.no_enable",
        *extra,
    ]


def test_load_metrics_of_known_counts() -> None:
    assert load_metrics([5.0, 5.0, 5.0, 5.0]) == (1.0, 1.0, 1.0)
    hi, lo, entropy = load_metrics([8.0, 0.0, 0.0, 0.0])
    assert (hi, lo, entropy) == (4.0, 0.0, 0.0)
    hi, lo, entropy = load_metrics([3.0, 1.0])
    assert (hi, lo) == (1.5, 0.5) and 0.8 < entropy < 0.82  # H(3/4, 1/4) / log 2 = 0.811


def test_moe_metrics_reach_jsonl_console_and_mlflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every log step (1, 2, 4) carries moe/* in metrics.jsonl and in the MLflow run; the
    console line carries the aux loss and the worst load."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("moe", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    monkeypatch.setenv(RUN_ID_ENV, run_id)
    monkeypatch.setenv(TRACKING_URI_ENV, uri)
    dump = tmp_path / "out"
    # The titan logger does not propagate: listen on it directly (its console handler writes
    # to whatever stdout was when an earlier test set it up).
    init_logger()  # first, or it replaces the handlers added here
    logger.addHandler(caplog.handler)
    try:
        run(parse_args(_args(dump)))
    finally:
        logger.removeHandler(caplog.handler)
    flavor = get_flavor("qwen3_moe", "debugmodel_tiny")
    top_k, experts = flavor.moe.top_k, flavor.moe.num_experts
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 4]
    for r in logged:
        # E * sum_e f_e P_e is top_k for a uniform router; a fresh router is near uniform.
        assert top_k * 0.9 < r["moe/aux_loss"] < top_k * 1.2, r
        assert r["moe/load_max"] >= 1.0 >= r["moe/load_min"] >= 0.0
        assert 0.5 < r["moe/load_entropy"] <= 1.0
        for i in range(flavor.n_layers):
            layer = [r[f"moe/layer{i}/{k}"] for k in ("load_max", "load_min", "load_entropy")]
            assert layer[0] <= r["moe/load_max"] and layer[1] >= r["moe/load_min"]
            assert 0.0 < layer[2] <= 1.0
            # counts are integers over 32 tokens x top_k slots: max / mean is a multiple of
            # E / (tokens * top_k) of a batch of local_batch_size sequences
            slots = 32 * 4 * top_k
            assert abs(layer[0] * slots / experts - round(layer[0] * slots / experts)) < 1e-6
    steps = [r.getMessage() for r in caplog.records if "grad_norm:" in r.getMessage()]
    assert len(steps) == 3 and all("aux: " in m and "load_max: " in m for m in steps)
    for key in ("moe/aux_loss", "moe/load_max", "moe/load_entropy", "moe/layer1/load_min"):
        history = client.get_metric_history(run_id, key)
        by_step = {m.step: m.value for m in history}
        assert sorted(by_step) == [1, 2, 4], key
        assert by_step[4] == pytest.approx(logged[-1][key])


@pytest.mark.parametrize("flavor, moves", [("debugmodel_shared", True), ("debugmodel_tiny", False)])
def test_loss_free_bias_moves_only_when_enabled(tmp_path: Path, flavor: str, moves: bool) -> None:
    """debugmodel_shared balances without the aux loss: its expert bias follows the load after
    every step (sign steps of bias_update_rate, mean zero); other flavors keep a zero bias and
    log the aux loss."""
    trainer = Trainer(parse_args(_args(tmp_path, "--model.flavor", flavor)))
    try:
        history = trainer.train()
        layers = moe_layers(trainer.model)
        assert layers
        rate = get_flavor("qwen3_moe", flavor).moe.bias_update_rate
        for layer in layers.values():
            bias = layer.expert_bias
            if moves:
                assert bias.abs().max() > 0.5 * rate
                assert abs(bias.sum().item()) < 1e-6  # updates are centred
            else:
                assert torch.count_nonzero(bias) == 0
        assert ("moe/aux_loss" in history[-1]) is not moves  # the shared flavor turns it off
        assert "moe/load_entropy" in history[-1]
    finally:
        trainer.close()


def test_aux_gradient_gets_the_microbatch_loss_factor(tmp_path: Path) -> None:
    """Gradient accumulation over 2 microbatches: every gradient equals that of
    sum_i (CE_i + coef * sum_layers aux_i) / 2 written out by hand (the aux loss as its
    formula on the router's scores). A doubled or missing aux gradient fails: the test checks
    that the aux term moves the router's gradient far beyond the tolerance."""
    args = _args(tmp_path, "--training.local_batch_size", "2")
    args += ["--training.gradient_accumulation_steps", "2", "--training.max_norm", "1e9"]
    trainer = Trainer(parse_args(args))
    try:
        reference = copy.deepcopy(trainer.model)
        data = iter(trainer.dataloader)
        batches = [next(data), next(data)]
        trainer.train_step(batches)
        got = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()

    def by_hand(with_aux: bool) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(reference)
        scores: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        for layer in moe_layers(model).values():
            coef, args_ = layer.args.aux_loss_coef, layer.args
            layer.args = dataclasses.replace(layer.args, aux_loss_coef=0.0)  # no injection
            layer.router.register_forward_hook(
                lambda mod, inp, out, a=args_: scores.append((out[0], out[1], a))
            )
        for inputs, labels in batches:
            scores.clear()
            loss = cross_entropy_loss(model(inputs), labels)
            for s, ids, a in scores:
                counts = torch.bincount(ids.reshape(-1), minlength=a.num_experts).float()
                fraction = counts / counts.sum() * a.top_k
                aux = a.num_experts * torch.sum(fraction * s.mean(dim=0))
                loss = loss + (coef * aux if with_aux else 0.0)
            (loss / len(batches)).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    expected, without = by_hand(True), by_hand(False)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-8, msg=name)
    gate = next(n for n in got if n.endswith("router.gate.weight"))
    effect = (expected[gate] - without[gate]).abs().max()
    assert effect > 100 * (1e-5 * expected[gate].abs().max() + 1e-8), effect


@pytest.mark.multiprocess
def test_pp2_x_ep2_logs_the_single_process_load(tmp_path: Path) -> None:
    """4 gloo processes, PP 2 x FSDP 2 with EP 2, from one seed: rank 0 logs every layer's
    load (counts summed over the data ranks, then gathered over the stages; the pipeline's
    first-step shape inference left out) exactly as one process does at step 1, and the aux
    loss near it (under PP it is computed per microbatch)."""
    from parallel_harness import QWEN3_MOE_MODEL, make_seed_checkpoint, train_layout

    seed = make_seed_checkpoint(tmp_path / "seed", QWEN3_MOE_MODEL)
    train_layout(tmp_path / "one", seed, nproc=1, dp=1, steps=2, model=QWEN3_MOE_MODEL)
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree"]
    four = train_layout(
        tmp_path / "four", seed, nproc=4, dp=2, extra=[*pp, "2"], steps=2, model=QWEN3_MOE_MODEL
    )
    assert "Expert parallel 2" in four.output
    rows = {}
    for name in ("one", "four"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = next(r for r in map(json.loads, lines) if "loss" in r)
    layers = [k for k in rows["one"] if k.startswith("moe/layer")]
    assert len(layers) == 3 * 4  # 4 layers x (load_max, load_min, load_entropy)
    for key in [*layers, "moe/load_max", "moe/load_min", "moe/load_entropy"]:
        assert rows["four"][key] == pytest.approx(rows["one"][key], rel=1e-12), key
    assert rows["four"]["moe/aux_loss"] == pytest.approx(rows["one"]["moe/aux_loss"], rel=0.05)
