"""deployments: filled in by the pipeline issue."""
