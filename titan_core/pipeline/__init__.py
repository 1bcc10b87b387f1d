"""The pipeline's logic outside any orchestrator: what Prefect tasks, the CLIs and tests share.

Modules here import neither Prefect nor anything in ``flows/`` or ``tasks/``; a Prefect task is
a thin wrapper that calls one of these functions and returns its small typed result.
"""
