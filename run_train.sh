#!/usr/bin/env bash
# Launch titan_core.train under torchrun on this host.
#   NGPU=2 MODULE=llama3 CONFIG=llama3_debugmodel ./run_train.sh --training.steps 20
# Env: NGPU (processes, default 1), MODULE/CONFIG (registry recipe; default llama3_debugmodel
# unless CONFIG_FILE is given), CONFIG_FILE (TOML),
# LOG_RANK (comma-separated ranks whose output is shown, default 0), COMM_MODE (fake_backend or
# local_tensor: one process simulates NGPU ranks, see titan_core/comm_mode.py).
# Further arguments are config overrides (--section.field value).
set -euo pipefail

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-}
COMM_MODE=${COMM_MODE:-}
if [ -z "${MODULE:-}${CONFIG:-}" ] && [ -z "$CONFIG_FILE" ]; then
  MODULE=llama3 CONFIG=llama3_debugmodel  # the default recipe, unless a config file is given
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -x "$here/.venv/bin/python" ] && [ -z "${VIRTUAL_ENV:-}" ]; then
  PATH="$here/.venv/bin:$PATH"
fi

args=()
[ -n "${MODULE:-}${CONFIG:-}" ] && args+=(--module "${MODULE:-llama3}" --config "${CONFIG:-}")
[ -n "$CONFIG_FILE" ] && args+=(--job.config_file "$CONFIG_FILE")
[ -n "$COMM_MODE" ] && args+=(--comm.mode "$COMM_MODE")

# One launch path: `titan train` builds the torchrun command with titan_core.launch (the same
# builder as `titan launch` and the pipeline's train task); COMM_MODE runs one process that
# simulates NGPU ranks (titan_core/comm_mode.py). `./run_train.sh --dry-run` prints the command.
export PYTHONUNBUFFERED=1
exec python -m titan_core.cli train --ngpu "$NGPU" --log-rank "$LOG_RANK" "${args[@]}" "$@"
