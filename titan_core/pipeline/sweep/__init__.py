"""Hyperparameter sweeps: the plan (``plan``), early stopping (``early_stop``, ``monitor``), the
sweep in MLflow (``tracking``) and the comparison people read (``report``)."""
