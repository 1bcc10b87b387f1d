"""The pipeline's stages without an orchestrator, one module each (``tasks/`` wraps them)."""
