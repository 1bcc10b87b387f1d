"""Pipeline-shaped MLflow runs for comparison tests, logged through the engine's own code.

A parent run carries the flattened resolved config as params (the pipeline's own
``titan_core.pipeline.run.tracking.log_params``); a nested ``train`` run gets its
per-step metrics from the trainer's ``MetricsProcessor`` through the ``MlflowSink`` (the names
the pipeline logs: ``train/*``); a nested ``evaluate`` run gets the eval loss and perplexity, and
the parent the final ``train/loss`` and ``eval/*`` at the last step, as ``publish`` does.
"""

from __future__ import annotations

import math

import torch
from mlflow import MlflowClient

from titan_core.components.metrics import MemoryMonitor, MetricsProcessor
from titan_core.components.mlflow_sink import MlflowSink
from titan_core.pipeline.run.tracking import STAGE_TAG, log_params
from titan_core.resolve import parse_args


def log_pipeline_run(
    uri: str, experiment: str, name: str, argv: list[str], evals: dict[str, float] | None = None
) -> tuple[str, list[float], float]:
    """Log one run of the config ``argv``; returns (run id, per-step losses, eval perplexity).

    The loss falls linearly with ``optimizer.lr`` so runs of different configs differ. ``evals``
    (``eval/<name>/<metric>``) are logged as the evaluators' numbers: in the loop on the train
    run, by the evaluate stage, and on the parent at the last step.
    """
    cfg = parse_args(argv)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run_id = client.create_run(exp_id, run_name=name, tags={STAGE_TAG: "pipeline"}).info.run_id
    log_params(client, run_id, cfg)
    nested = {"mlflow.parentRunId": run_id}
    train = client.create_run(exp_id, run_name="train", tags={**nested, STAGE_TAG: "train"})
    sink = MlflowSink(train.info.run_id, uri)
    memory = MemoryMonitor(torch.device("cpu"))
    proc = MetricsProcessor(cfg.metrics, 1000, 1.0, memory, [sink])
    losses = []
    for step in range(1, cfg.training.steps + 1):
        loss = 9.0 - step * cfg.optimizer.lr * 500
        proc.add_step(cfg.training.seq_len * cfg.training.local_batch_size)
        proc.log(step, loss, grad_norm=1.0, lr=cfg.optimizer.lr)
        losses.append(loss)
    proc.close()
    assert sink.num_failed == 0 and sink.num_logged == cfg.training.steps
    client.set_terminated(train.info.run_id)
    evaluate = client.create_run(
        exp_id, run_name="evaluate", tags={**nested, STAGE_TAG: "evaluate"}
    )
    ppl = 2.0 ** losses[-1]  # eval/loss is its natural log, as the evaluator's
    for key, value in (evals or {}).items():
        client.log_metric(train.info.run_id, key, value, step=cfg.training.steps)
    final = {"eval/loss": math.log(ppl), "eval/perplexity": ppl, **(evals or {})}
    for name, value in final.items():
        client.log_metric(evaluate.info.run_id, name, value)
        client.log_metric(run_id, name, value, step=cfg.training.steps)
    client.set_terminated(evaluate.info.run_id)
    client.log_metric(run_id, "train/loss", losses[-1], step=cfg.training.steps)
    client.set_terminated(run_id)
    return run_id, losses, ppl
