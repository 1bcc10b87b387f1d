"""The pipeline's logic outside any orchestrator: what Prefect tasks, the CLIs and tests share.

Modules here import neither Prefect nor anything in ``flows/`` or ``tasks/``; a Prefect task is
a thin wrapper that calls one of these functions and returns its small typed result, handing in
what only Prefect has (its run logger, its Secret blocks: ``tasks/runtime.py``).

Rooms, each importing only the ones before it:

- ``run/``: run infrastructure every stage shares: the run-root layout (``paths``), transfers and
  credentials (``transfer``), MLflow tracking (``tracking``, ``params``), the run's config
  (``config``), redaction and logging (``common``), report pieces (``report``), console errors;
- ``stages/``: one module per pipeline stage (tokenizer, data, preflight, seed, training, export,
  evaluation, publish with its model card) and the model line a retrain continues;
- ``compare`` (and how it reads: ``compare_view``) and ``parity``: comparing MLflow runs; the
  parallelism-parity recipe;
- ``sweep/``: sweeps: the plan, early stopping and its monitor, MLflow runs and the report.
"""
