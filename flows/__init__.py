"""Prefect flows: compositions of ``tasks`` (pretrain_pipeline, retrain, convert, evaluate, ...)."""
