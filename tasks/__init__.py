"""tasks: filled in by the pipeline issue."""
