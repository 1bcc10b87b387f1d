"""Run storage moved to ``titan_core.pipeline.storage``; re-exported for the tasks' imports."""

from titan_core.pipeline.storage import (  # noqa: F401  (re-exports)
    SEED_DIR,
    RunPaths,
    StorageError,
    absolute,
    check_storage,
    configure_credentials,
    download_file,
    new_run_id,
    refresh,
    same_location,
    storage_identity,
    upload_folder,
)
