"""What people read about a published export: its model card (``README.md`` in the Hugging Face
folder), the registered model version's description, and how to open a run's locations.

Plain text from plain facts (no Prefect, no MLflow), so the pipeline's publish stage, a CLI or a
test renders the same words.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.config.metrics import direction
from titan_core.pipeline.run.common import load_config, redact
from titan_core.pipeline.run.report import markdown_table
from titan_core.pipeline.stages.evaluation import Evaluation

CARD = "README.md"


@dataclass(frozen=True)
class ExportFacts:
    """The facts a model card and a model version's description state about one export."""

    run_id: str
    experiment: str
    recipe: str
    """Registry recipe the run started from ("" when unknown, e.g. a retrain)."""
    family: str
    flavor: str
    dataset: str
    steps: int
    tokens: int
    """Tokens trained on: steps x global batch x sequence length."""
    seq_len: int
    export_url: str
    export_dtype: str
    """Dtype of the exported weights (``torch_dtype`` of its config.json)."""
    checkpoint_url: str
    checkpoint_dtype: str
    """Dtype the evaluated DCP checkpoint stores its weights in."""
    eval_compute_dtype: str
    """Dtype the evaluation's forward pass ran in."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    registered_model: str = ""


def training_data(cfg: JobConfig) -> str:
    """The run's training data as one line: the mix, the prepared path or the dataset name."""
    return cfg.dataloader.mix or cfg.dataloader.location


def tokens_trained(cfg: JobConfig) -> int:
    """``training.steps`` x global batch (micro-batch x accumulation x data-parallel ranks) x
    ``training.seq_len``."""
    from titan_core.distributed.parallel_dims import ParallelDims

    t = cfg.training
    dims = ParallelDims.from_config(cfg.parallelism, cfg.launch.nnodes * cfg.launch.nproc_per_node)
    dp = dims.dp_replicate * dims.dp_shard
    return t.steps * t.local_batch_size * t.gradient_accumulation_steps * dp * t.seq_len


def eval_dtypes(cfg: JobConfig, checkpoint_model_only: bool) -> tuple[str, str]:
    """(stored dtype of the final checkpoint, forward dtype of the pipeline's one-process eval):
    a model-only final save is in ``checkpoint.export_dtype``, a full one keeps float32 master
    weights; the eval autocasts to ``training.autocast_dtype`` (float32: none)."""
    stored = cfg.checkpoint.export_dtype if checkpoint_model_only else "float32"
    return stored, cfg.training.autocast_dtype


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _eval_rows(facts: ExportFacts) -> list[tuple[str, str]]:
    names = {"loss": "eval loss", "perplexity": "perplexity", "bits_per_byte": "bits per byte"}
    names["num_tokens"] = "eval tokens"
    m = facts.eval_metrics
    return [(label, _fmt(m[key])) for key, label in names.items() if key in m]


def evaluator_lines(facts: ExportFacts) -> list[str]:
    """The ``[evaluators]``' numbers on the final checkpoint (``eval/<name>/<metric>``, their
    timings aside), a row each with the way it improves; none without evaluators."""
    rows = [
        [f"`eval/{key}`", _fmt(value), direction(key)]
        for key, value in facts.eval_metrics.items()
        if "/" in key and not key.endswith("/seconds")
    ]
    if not rows:
        return []
    return [
        "## Evaluators",
        "",
        "Held-out sets and downstream tasks of the run's `[evaluators]`, scored on the final "
        "checkpoint as training scored them in the loop (docs/evaluation.md).",
        "",
        *markdown_table(["metric", "value", "better"], rows, right={1}),
        "",
    ]


def precision_note(facts: ExportFacts) -> str:
    """One paragraph saying which weights the eval numbers belong to."""
    same = facts.export_dtype == facts.checkpoint_dtype == facts.eval_compute_dtype
    note = (
        f"The weights in this folder are **{facts.export_dtype}**. The evaluation numbers were "
        f"measured on the DCP checkpoint `{facts.checkpoint_url}` (weights stored in "
        f"{facts.checkpoint_dtype}, forward pass in {facts.eval_compute_dtype})"
    )
    if same:
        return note + ", the same precision as this export."
    return note + f"; this {facts.export_dtype} export may score slightly differently."


def load_snippet(export_url: str) -> str:
    """Python that loads the export with transformers (S3 exports are copied locally first)."""
    folder = export_url
    lines = ["```python"]
    if export_url.startswith("s3://"):
        folder = "./model"
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        flag = f"--endpoint-url {endpoint} " if endpoint else ""
        lines = ["```bash", f"aws s3 sync {flag}{export_url} ./model", "```", "", "```python"]
    lines += [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{folder}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
        "```",
    ]
    return "\n".join(lines)


def model_card(facts: ExportFacts) -> str:
    """The export's ``README.md``: what was trained, on what, how well, and how to load it."""
    recipe = f"`{facts.recipe}`" if facts.recipe else "(none: continued from a checkpoint)"
    facts_rows = [
        ("recipe", recipe),
        ("model", f"{facts.family} / {facts.flavor}"),
        ("training data", f"`{facts.dataset}`"),
        ("training steps", f"{facts.steps:,}"),
        ("tokens trained", f"{facts.tokens:,} (sequence length {facts.seq_len:,})"),
    ]
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [titan, {facts.family}]",
        "---",
        "",
        f"# {facts.family} {facts.flavor}: run `{facts.run_id}`",
        "",
        f"Pre-trained by titan's pipeline (experiment `{facts.experiment}`"
        + (f", registered model `{facts.registered_model}`" if facts.registered_model else "")
        + ").",
        "",
        *markdown_table(2, [*facts_rows, *_eval_rows(facts)]),  # no header: facts by name
        "",
        *evaluator_lines(facts),
        "## Precision",
        "",
        precision_note(facts),
        "",
        "## Load it",
        "",
        load_snippet(facts.export_url),
        "",
    ]
    return "\n".join(lines)


def version_description(facts: ExportFacts) -> str:
    """The registered model version's description (markdown, a few lines)."""
    recipe = f"recipe `{facts.recipe}`" if facts.recipe else "a continued checkpoint"
    loss = facts.eval_metrics.get("loss")
    measured = f"eval loss {loss:.4g}" if loss is not None else "not evaluated"
    return (
        f"{facts.family} {facts.flavor} from {recipe}: {facts.steps:,} steps "
        f"({facts.tokens:,} tokens) on `{facts.dataset}`; {measured} "
        f"(on the {facts.checkpoint_dtype} checkpoint). Export: `{facts.export_url}` "
        f"({facts.export_dtype}), run `{facts.run_id}`."
    )


def location_markdown(title: str, url: str, what: str) -> str:
    """How to open a stored location, for a Prefect artifact: a local path as text with a shell
    command; an S3 URL with the AWS CLI (and the console link when it is AWS itself)."""
    lines = [f"# {title}", "", what, ""]
    if url.startswith("s3://"):
        bucket, _, key = url.removeprefix("s3://").partition("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        flag = f"--endpoint-url {endpoint} " if endpoint else ""
        lines += [f"`{url}`", "", "```bash", f"aws s3 ls {flag}{url}/", "```"]
        if not endpoint:
            console = f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={key}/"
            lines += ["", f"[Open in the AWS console]({console})"]
    elif "://" in url:
        listing = f"import fsspec; print(fsspec.open_files('{url}/*'))"
        lines += [f"`{url}`", "", "```bash", f'python -c "{listing}"', "```"]
    else:
        lines += [
            f"`{url}` on the machine that ran the flow.",
            "",
            "```bash",
            f"ls -la {url}",
            "```",
        ]
    return "\n".join(lines) + "\n"


def export_facts(
    run_root: str,
    checkpoint_url: str,
    hf_url: str,
    evaluation: Evaluation,
    recipe: str = "",
    registered_model: str = "",
) -> ExportFacts:
    """The facts about an export, read from the run's stored config, the export's
    ``config.json`` and the final checkpoint's commit marker; ``evaluation`` is the evaluate
    stage's result."""
    from titan_core.checkpoint.manager import read_marker

    cfg = load_config(storage.join(run_root, "config.toml"))
    hf_config = json.loads(storage.read_text(storage.join(hf_url, "config.json")))
    marker = read_marker(checkpoint_url) or {}
    stored, compute = eval_dtypes(cfg, bool(marker.get("model_only", False)))
    local = not storage.is_url(hf_url)
    return ExportFacts(
        run_id=run_root.rstrip("/").rsplit("/", 1)[-1],
        experiment=cfg.job.experiment,
        recipe=recipe,
        family=cfg.model.name,
        flavor=cfg.model.flavor,
        dataset=redact(training_data(cfg)),
        steps=evaluation.step,
        tokens=tokens_trained(cfg),
        seq_len=cfg.training.seq_len,
        export_url=redact(os.path.abspath(hf_url) if local else hf_url),
        export_dtype=str(hf_config.get("torch_dtype", "unknown")),
        checkpoint_url=redact(checkpoint_url),
        checkpoint_dtype=stored,
        eval_compute_dtype=compute,
        eval_metrics={k: float(v) for k, v in evaluation.metrics.items()},
        registered_model=registered_model,
    )


def write_model_card(hf_url: str, facts: ExportFacts) -> str:
    """Write ``README.md`` into the export folder (a path or URL); returns its URL."""
    url = storage.join(hf_url, CARD)
    storage.write_text(url, redact(model_card(facts)))
    return url
