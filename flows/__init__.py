"""flows: filled in by the pipeline issue."""
