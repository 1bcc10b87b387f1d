"""Prefect tasks: thin typed adapters over ``titan_core`` that pass URLs between stages."""
