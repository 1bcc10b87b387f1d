"""Run infrastructure: what every stage of a pipeline run shares (layout, storage transfers,
tracking, config, logging, reports)."""
