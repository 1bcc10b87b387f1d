"""The words people read about an export: model card, model-version description, locations.

The pipeline test (tests/test_pipeline.py) checks them on a real run; these cover the cases one
run cannot: a local export, matching precisions, the AWS console link.
"""

from __future__ import annotations

import dataclasses

import pytest

from titan_core.pipeline.stages.model_card import (
    ExportFacts,
    location_markdown,
    model_card,
    tokens_trained,
    version_description,
)
from titan_core.resolve import parse_args

FACTS = ExportFacts(
    run_id="20260101-120000-ab12cd",
    experiment="titan",
    recipe="llama3_debugmodel",
    family="llama3",
    flavor="debugmodel",
    dataset="titan_corpus",
    steps=20,
    tokens=20 * 8 * 2048,
    seq_len=2048,
    export_url="/runs/titan/20260101-120000-ab12cd/hf",
    export_dtype="bfloat16",
    checkpoint_url="/runs/titan/20260101-120000-ab12cd/checkpoint/step-20",
    checkpoint_dtype="float32",
    eval_compute_dtype="float32",
    eval_metrics={
        "loss": 5.123456,
        "perplexity": 167.9,
        "bits_per_byte": 1.2345,
        "num_tokens": 40960,
    },
    registered_model="titan",
)


def test_model_card_says_what_was_trained_and_which_precision_was_measured() -> None:
    card = model_card(FACTS)
    assert card.startswith("---\nlibrary_name: transformers\n")
    for row in (
        "| recipe | `llama3_debugmodel` |",
        "| model | llama3 / debugmodel |",
        "| training data | `titan_corpus` |",
        "| training steps | 20 |",
        "| tokens trained | 327,680 (sequence length 2,048) |",
        "| eval loss | 5.123 |",
        "| perplexity | 167.9 |",
        "| eval tokens | 40,960 |",
    ):
        assert row in card, row
    assert "**bfloat16**" in card and "may score slightly differently" in card
    assert f'AutoModelForCausalLM.from_pretrained("{FACTS.export_url}")' in card
    assert "aws s3" not in card  # a local export loads from its path
    same = dataclasses.replace(FACTS, export_dtype="float32")
    assert "the same precision as this export" in model_card(same)


def test_s3_export_card_and_locations(monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = dataclasses.replace(FACTS, export_url="s3://bucket/titan/run/hf", recipe="")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.internal:8333")
    card = model_card(s3)
    assert (
        "aws s3 sync --endpoint-url http://s3.internal:8333 s3://bucket/titan/run/hf ./model"
        in card
    )
    assert 'from_pretrained("./model")' in card and "(none: continued from a checkpoint)" in card
    where = location_markdown("Run root", "s3://bucket/titan/run", "Checkpoints.")
    assert "aws s3 ls --endpoint-url http://s3.internal:8333 s3://bucket/titan/run/" in where
    assert "console.aws" not in where  # not AWS itself: no console to link
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    where = location_markdown("Run root", "s3://bucket/titan/run", "Checkpoints.")
    assert "https://s3.console.aws.amazon.com/s3/buckets/bucket?prefix=titan/run/" in where
    local = location_markdown("Run root", "/runs/titan/run", "Checkpoints.")
    assert "file://" not in local and "ls -la /runs/titan/run" in local


def test_version_description_and_tokens() -> None:
    text = version_description(FACTS)
    assert text.startswith("llama3 debugmodel from recipe `llama3_debugmodel`: 20 steps")
    assert (
        "eval loss 5.123" in text and "`/runs/titan/20260101-120000-ab12cd/hf` (bfloat16)" in text
    )
    cfg = parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel", "--launch.nproc_per_node", "2"]
    )
    t = cfg.training
    assert tokens_trained(cfg) == t.steps * t.local_batch_size * 2 * t.seq_len


def test_model_card_lists_the_evaluators_numbers() -> None:
    scores = {"ns/acc": 0.3125, "ns/bits_per_byte": 2.5, "ns/seconds": 1.5, "corpus/loss": 4.25}
    facts = dataclasses.replace(FACTS, eval_metrics={**FACTS.eval_metrics, **scores})
    card = model_card(facts)
    section = card.split("## Evaluators", 1)[1].split("## Precision", 1)[0]
    assert "| metric | value | better |" in section
    for row in (
        "| `eval/ns/acc` | 0.3125 | higher |",
        "| `eval/ns/bits_per_byte` | 2.5 | lower |",
        "| `eval/corpus/loss` | 4.25 | lower |",
    ):
        assert row in section, row
    assert "seconds" not in card  # timings are the report's, not the model's
    assert "## Evaluators" not in model_card(FACTS)  # none without evaluators
